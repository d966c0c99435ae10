import sys

from warmserve.cli import main

sys.exit(main())
