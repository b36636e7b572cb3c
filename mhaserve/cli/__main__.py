import sys

from .main import process_main

sys.exit(process_main())
