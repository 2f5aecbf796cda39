"""`python -m sync_runtime ...` is the `weightsync` command."""

from sync_runtime.cli.main import main

raise SystemExit(main())
