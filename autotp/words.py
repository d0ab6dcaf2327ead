"""Words as a person reads them: the article before a name that is only known at run time.

>>> with_article("inference"), with_article("train"), with_article("int"), with_article("8-dim")
('an inference', 'a train', 'an int', 'an 8-dim')
>>> with_article("OPTForCausalLM"), with_article("LlamaForCausalLM"), with_article("xpu"), with_article("11-dim")
('an OPTForCausalLM', 'a LlamaForCausalLM', 'an xpu', 'an 11-dim')
"""

from __future__ import annotations

import re

__all__ = ["with_article"]

# a vowel letter read as a vowel, a consonant read as one ("x" as in "ex"), a letter-by-letter
# capital abbreviation starting with a vowel sound (F, H, L, M, N, R, S, X), or a number said with
# a vowel first (8, 11, 18, 80-89, 800...)
_AN = re.compile(r"(?:(?i:[aeio]|u(?!ni|s[aeu]|til))|x|[FHLMNRSX](?=[A-Z0-9]|$)|8|1[18](?!\d))")


def with_article(word: str) -> str:
    """``word`` with "a" or "an" before it, as it is said: ``"an inference"``, ``"a tuple"``."""
    return f"{'an' if _AN.match(word) else 'a'} {word}"
