"""`python -m ktrun ...` is the `ktrun` command."""
from ktrun.cli import main

main()
