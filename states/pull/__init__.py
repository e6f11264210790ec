"""The pull machine, and how a model's name is looked up before a pull."""
