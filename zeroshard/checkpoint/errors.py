"""The one exception the checkpoint package raises for bad checkpoints and bad requests."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, unsafe or does not fit the model; the message names the file
    or key and says what to do."""
