"""``python -m scanforest.deploy.cli ARGS``: the ``scanforest`` command."""
from scanforest.deploy.cli import main

main()
