"""`python -m ktrun ...` is the `ktrun` command."""
from .cli import main

main()
