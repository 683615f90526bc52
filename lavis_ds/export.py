"""`python -m lavis_ds.export`, as older notes spell it: says that the command is `lavis-ds export` and exits (code 2).

It does not run the command: one spelling per job keeps notes and scripts from drifting apart, and the
message costs one retyped line.
"""
if __name__ == "__main__":
    from lavis_ds.cli import moved

    moved("lavis_ds.export", "export")
