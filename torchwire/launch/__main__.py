"""``python -m torchwire.launch``: see ``torchwire.launch``."""

import sys

from torchwire.launch import main

sys.exit(main())
