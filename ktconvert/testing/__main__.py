"""`python -m ktconvert.testing ARCH OUT_DIR [--fp8] ...` writes a fixture checkpoint."""
from ktconvert.testing.checkpoints import main

main()
