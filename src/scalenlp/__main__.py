import sys

from scalenlp.cli import main

sys.exit(main())
