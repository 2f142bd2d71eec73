"""How the scripts here end: ``sys.exit(run_main(main))`` under ``if __name__ == "__main__"``.

A mistake the user can fix (the library's own errors, ``GrowPageError``, such as ``--device
cuda`` where torch sees no CUDA device) ends the run as one line, ``<script>: error: ...``, and
exit status 2, as argparse and the ``growpage`` command do; anything else keeps its traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from growpage.errors import GrowPageError


def run_main(main: Callable[[], object]) -> int:
    """``main()``'s exit status (0 when it returns something else); 2 after a one-line error."""
    try:
        status = main()
    except GrowPageError as exc:
        print(f"{os.path.basename(sys.argv[0])}: error: {exc}", file=sys.stderr)
        return 2
    return status if isinstance(status, int) else 0
