"""What a trained run is used with, not how it trains: each module is a command (``lavis-ds <name>``, or
``python -m lavis_ds.apps.<name>``).

``export`` (a checkpoint of any engine to safetensors + config, loaded without DeepSpeed), ``generate``
(answers for images and prompts, or a whole data file under torchrun), ``chat`` (the terminal
conversation) and ``webui`` (the same conversation in a browser).

The libraries they share import no command: ``export_io`` (reading checkpoints, loading exports), ``export_hf*``
(``--format hf``: the transformers class of each architecture), and ``generation``; ``tests/test_layers.py`` checks
the export library's and that no import cycle runs through this package.
"""
