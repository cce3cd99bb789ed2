from __future__ import annotations
import faulthandler, sys
from tests.service import test_gc

def test_td(make_server, run_name) -> None:
    test_gc.test_interleaved_saves_and_gc_never_delete_live_blobs(make_server, "sqlite", run_name)
    faulthandler.dump_traceback_later(3, file=sys.stderr)
