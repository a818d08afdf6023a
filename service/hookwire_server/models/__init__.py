"""Models: the registry (hosts, states), loading from config, module patterns."""
