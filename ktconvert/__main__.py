"""`python -m ktconvert ...` is the `ktconvert` command."""
from ktconvert.cli import main

main()
