"""The pages a newcomer opens first stay short and their links lead somewhere: every relative
link in README.md, docs/, notebooks/README.md and the experiments' summaries names a file of the
repository, and every #anchor a heading of that file (GitHub's heading slugs)."""
import glob
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted(["README.md", "notebooks/README.md"]
               + [os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))]
               + [os.path.relpath(p, ROOT) for p in
                  glob.glob(os.path.join(ROOT, "experiments", "results", "*", "*.md"))])
# [text](target) and ![alt](target); a target ends at whitespace or ')'.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _read(rel: str) -> str:
  with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
    return f.read()


def slug(heading: str) -> str:
  """GitHub's anchor for a heading: lower case, punctuation other than '-' and '_' dropped,
  spaces to hyphens."""
  text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
  out, seen = set(), {}
  for line in FENCE.sub("", text).splitlines():
    m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
    if m:
      s = slug(m.group(1))
      n = seen.get(s, 0)
      seen[s] = n + 1
      out.add(s if n == 0 else f"{s}-{n}")
  return out


def test_slug_matches_github():
  assert slug("Sweeps: many runs, one CSV (`trm_jax.sweep`)") == "sweeps-many-runs-one-csv-trm_jaxsweep"
  assert slug("TRM bounds (Table 1)") == "trm-bounds-table-1"
  assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
  text = FENCE.sub("", _read(page))
  bad = []
  for target in LINK.findall(text):
    if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
      continue
    path, _, anchor = target.partition("#")
    dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
    if not os.path.exists(os.path.join(ROOT, dest)):
      bad.append(f"{target}: no file {dest}")
    elif anchor and dest.endswith(".md") and anchor not in anchors(_read(dest)):
      bad.append(f"{target}: no heading #{anchor} in {dest}")
  assert not bad, f"{page}: " + "; ".join(bad)


def test_front_pages_stay_short():
  assert len(_read("README.md").encode()) <= 12_000
  assert len(_read("docs/results.md").encode()) <= 40_000
  for page in ("README.md", "docs/results.md"):
    for line in _read(page).splitlines():
      if line.startswith("|"):
        cells = [c for c in line.strip().strip("|").split("|")]
        assert max(len(c.strip()) for c in cells) <= 400, f"{page}: table cell over 400: {line[:80]}"


def test_docs_describe_the_software_not_its_development():
  try:
    out = subprocess.run(
        ["git", "grep", "-n", "-i", "-E", r"\bsessions?\b|issue #[0-9]+|\bitem [0-9]+\b", "--",
         "README.md", "docs", "configs", "trm_jax", "bench", "experiments"],
        cwd=ROOT, capture_output=True, text=True, check=False)
  except FileNotFoundError:
    pytest.skip("git is not installed")
  if out.returncode == 128:
    pytest.skip("not a git checkout")
  assert out.returncode == 1 and not out.stdout, out.stdout
