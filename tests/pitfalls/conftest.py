"""The pitfall suite: each seed field-report failure, reproduced, must end in its specific error.

``pitfall_models`` (this folder, put on sys.path here) holds the stage modules that
reproduce bugs of user code: a branch cut off from the loss, a NaN in the forward.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
