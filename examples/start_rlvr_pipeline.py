"""Start an RLVR run: ``python examples/start_rlvr_pipeline.py --config_name rlvr_config``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from roll.launch.rlvr import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
