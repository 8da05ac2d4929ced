"""The `hookmech` command line (packaged as `hookmech.cli`): parsing and printing only."""
