import sys

from pdm_lab.cli.main import main

sys.exit(main())
