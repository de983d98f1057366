"""The training run: its config, data, one step, the loop and the rank launcher."""
