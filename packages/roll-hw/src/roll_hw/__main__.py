"""`python -m roll_hw` prints the doctor report."""

import sys

from roll_hw.doctor import main

sys.exit(main())
