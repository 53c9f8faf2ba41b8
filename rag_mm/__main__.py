"""``python -m rag_mm COMMAND ...``: the ``rag_mm`` command (rag_mm/cli.py) without installing."""

from rag_mm.cli import main

raise SystemExit(main())
