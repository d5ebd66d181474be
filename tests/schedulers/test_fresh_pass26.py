"""pass26: an adversarial pass on the ordered waiting queues and their docs.

- docs/schedulers.md's "Writing one" said "Then ``AsyncEngine.load(scheduler="shortest-first")``" right under the
  ``OrderedScheduler`` example, which registers ``shortest-first-ordered``: a reader who wrote that example and
  loaded the name beside it got an unknown scheduler. Each "Then ... ``scheduler="NAME"``" now follows the block
  that registers NAME.
"""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "schedulers.md"


def test_each_load_sentence_names_the_scheduler_registered_just_above_it() -> None:
    text = DOC.read_text()
    section = text[text.index("## Writing one"):text.index("## Testing one")]
    loads = list(re.finditer(r"Then `(?:await AsyncEngine\.load\()?scheduler=\"([\w-]+)\"", section))
    assert len(loads) >= 2, "both examples say how to load them"
    for load in loads:
        blocks = re.findall(r"```python\n(.*?)```", section[:load.start()], re.DOTALL)
        assert blocks, load.group(0)
        registered = re.findall(r'@register_scheduler\("([\w-]+)"\)', blocks[-1])
        assert registered == [load.group(1)], (load.group(0), registered)
