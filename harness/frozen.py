"""Imported last by the fork server (``forked.PRELOAD``): its imports, ~700k objects that live as long as every
process forked from it, move to the garbage collector's permanent generation before the first fork.

A forked process's collections then leave them alone: DeepSpeed calls ``gc.collect()`` as ZeRO-3 starts, and walking
them took ~1.2 s of CPU per call, and writing to each object's GC header copied the server's memory pages into the
process (copy-on-write). Frozen in the server, not in each process: freezing touches every object too.
"""
import gc

gc.freeze()
