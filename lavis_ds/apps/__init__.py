"""What a trained run is used with, not how it trains: each module is a command (``lavis-ds <name>``, or
``python -m lavis_ds.apps.<name>``).

``export`` (a checkpoint of any engine to safetensors + config, loaded without DeepSpeed), ``generate``
(answers for images and prompts, or a whole data file under torchrun), ``chat`` (the terminal
conversation) and ``webui`` (the same conversation in a browser).
"""
