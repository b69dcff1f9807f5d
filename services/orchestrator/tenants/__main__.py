"""`python -m services.orchestrator.tenants`: see cli.py."""

import sys

from services.orchestrator.tenants.cli import main

sys.exit(main())
