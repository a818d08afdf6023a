"""What runs the models: the per-model scheduler, batch slicing and joins."""
