import sys

import pytest

from s2t2_dist.recipes.orchestrate import Runner, StageFailed


def test_a_rerun_appends_to_the_jobs_log_and_keeps_the_failed_attempt(tmp_path):
    r = Runner(ranks=1, in_process=False, log_dir=tmp_path, echo=False)
    fail = [sys.executable, "-c", "import sys; print('first attempt: out of memory'); sys.exit(3)"]
    with pytest.raises(StageFailed, match="out of memory"):
        r._subprocess(fail, "job", "fail-cmd")
    log = r._subprocess([sys.executable, "-c", "print('second attempt: done')"], "job", "ok-cmd")
    text = log.read_text()
    assert text.startswith("$ fail-cmd\nfirst attempt: out of memory\n")
    assert "--- rerun at " in text and text.index("first attempt") < text.index("$ ok-cmd") < text.index("second attempt")
