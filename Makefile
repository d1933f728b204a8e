# The two commands a newcomer types.
.PHONY: setup test demo
setup:
	bash scripts/setup.sh

test: setup
	.venv/bin/python -m pytest tests -q -p no:cacheprovider

demo: setup
	.venv/bin/python scripts/demo.py
