"""The documentation site: it builds strictly, its generated pages match the code, every ``docs/...md#anchor`` the
code cites exists, and no code cites notes that live outside the repository."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CODE_DIRS = (
    "arpo_base",
    "arpo_env",
    "arpo_algo",
    "serve",
    "experiments",
    "benchmarks",
    "studies",
    "examples",
    "tests",
    "scripts",
    "docker",
)
CODE_SUFFIXES = {".py", ".toml", ".yaml", ".yml", ".sh", ""}
#: A citation of a documentation page from code: ``docs/concepts/arpo.md#limit-eos``.
DOC_REF = re.compile(r"(?<![\w/.])docs/([\w./-]+\.md)(?:#([\w-]+))?")
#: Notes kept outside the repository; code that cites them sends a reader to something they cannot open.
OUTSIDE = re.compile(
    "|".join(
        [
            "ARPO" + "_SPEC",
            "RAY" + "_NOTES",
            "GPU" + "_NOTES",
            "VLLM_CPU" + "_NOTES",
            r"\.\./shared/" + "docs",
            r"\bSTYLE" + r"\.md",
            r"\bPEERS" + r"\.md",
        ]
    )
)
#: A bare section sign cites a section of such a note; a paper's section is cited with the paper (DAPO, arXiv id).
BARE_SECTION = re.compile(r"\u00a7\s?\d")
PAPER = re.compile(r"DAPO|arXiv")
#: The strict build must stay quick enough to run with the unit tests.
BUILD_LIMIT_S = 60.0


def _code_files() -> list[Path]:
    files = []
    for top in CODE_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and path.suffix in CODE_SUFFIXES and "__pycache__" not in path.parts:
                files.append(path)
    return [f for f in files if f.resolve() != Path(__file__).resolve()]


def slug(text: str) -> str:
    """MkDocs' (Python-Markdown toc) heading id: markup dropped, lowercase, punctuation dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text).replace("`", "").replace("*", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    """The heading ids of a Markdown page (headings inside code fences are not headings)."""
    found, fenced = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            found.add(slug(line.lstrip("#").strip()))
    return found


def test_slug_follows_mkdocs_rules():
    assert slug("Limit EOS") == "limit-eos"
    assert slug("The learner on a GPU: precision, tree attention, determinism") == (
        "the-learner-on-a-gpu-precision-tree-attention-determinism"
    )
    assert slug("`arpo tune` sweeps") == "arpo-tune-sweeps"


def test_site_builds_strictly(tmp_path):
    """``mkdocs build --strict``: a broken link or anchor, or a nav entry without its page, fails the build."""
    start = time.monotonic()
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(tmp_path / "site")]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "index.html").exists()
    assert took < BUILD_LIMIT_S, f"the strict build took {took:.1f} s"
    print(f"strict build: {took:.1f} s")


def test_generated_reference_pages_match_the_code():
    proc = subprocess.run(
        [sys.executable, "scripts/gen_reference.py", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr.strip() or "regenerate with: python scripts/gen_reference.py"


def test_every_setting_has_a_sentence_and_the_page_lists_every_setting():
    script = (
        "import sys; sys.path.insert(0, 'scripts'); import gen_reference as g; "
        "print('\\n'.join(f\"{r['name']} {int(bool(r['doc']))}\" for r in g.settings_rows()))"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = dict(line.split() for line in proc.stdout.splitlines())
    assert len(rows) > 50
    assert not [n for n, ok in rows.items() if ok == "0"], "settings without a sentence"
    page = (DOCS / "reference" / "settings.md").read_text(encoding="utf-8")
    assert not [n for n in rows if f"`{n}`" not in page]


def test_settings_page_shows_each_algorithms_own_defaults():
    """A setting whose default differs for GRPO or AEPO (their configs' settings, not a table) says so on its row."""
    from arpo_algo.algorithms import AEPOConfig, ARPOConfig, GRPOConfig
    from arpo_algo.algorithms.settings import Settings

    base = Settings().flat()
    rows = {
        line.split(" | ")[0].strip("| `"): line
        for line in (DOCS / "reference" / "settings.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("| `")
    }
    shown = 0
    for cls in (ARPOConfig, GRPOConfig, AEPOConfig):
        for name, value in cls().settings.flat().items():
            if value != base[name]:
                assert f"({cls.variant.upper()}: `{value!r}`)" in rows[name], (cls.__name__, name, rows[name])
                shown += 1
    assert shown >= 5


def test_doc_references_in_code_resolve():
    """Every ``docs/PAGE.md#anchor`` cited in code names an existing page and one of its headings."""
    broken = []
    cache: dict[Path, set[str]] = {}
    for path in _code_files():
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for page_name, anchor in DOC_REF.findall(line):
                page = DOCS / page_name
                where = f"{path.relative_to(ROOT)}:{n}"
                if not page.is_file():
                    broken.append(f"{where}: no page docs/{page_name}")
                elif anchor and anchor not in cache.setdefault(page, anchors(page)):
                    broken.append(f"{where}: docs/{page_name} has no heading #{anchor}")
    assert not broken, "\n".join(broken)


def test_code_cites_nothing_outside_the_repository():
    """Design notes outside the repository are cited nowhere; their rules live in the Concepts and How-to pages."""
    offenders = []
    for path in _code_files():
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if OUTSIDE.search(line) or BARE_SECTION.search(line) and not PAPER.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not offenders, "cite a docs/...md#anchor instead:\n" + "\n".join(offenders)


def test_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines"
    first_block = text.split("```", 2)[1]
    assert "./scripts/quickstart" in first_block and "./scripts/test" in first_block
    assert not re.search(r"\bissue \d+|/work/|\.\./shared", text, re.IGNORECASE)
    for page in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / page).is_file(), page


def is_stub(page: Path) -> bool:
    """A page that moved: its title ends in "(moved)" and it only points to where its content went."""
    return page.read_text(encoding="utf-8").splitlines()[0].rstrip().endswith("(moved)")


RESULTS_PAGES = sorted(p.name for p in (DOCS / "results").glob("*.md") if p.name != "index.md" and not is_stub(p))


@pytest.mark.parametrize("page", RESULTS_PAGES)
def test_results_pages_state_date_machine_and_command(page):
    text = (DOCS / "results" / page).read_text(encoding="utf-8")
    for field in ("**Date:**", "**Machine", "**Command"):
        assert field in text, f"docs/results/{page} lacks {field}"


#: A how-to section a reader can scan: at most this many words of prose (code blocks not counted).
HOWTO_SECTION_WORDS = 400
#: Results are evidence for the rest of the site, not most of it: at most this share of the site's words.
RESULTS_SHARE = 0.25
#: A moved page is a pointer, not a second copy of its content.
STUB_WORDS = 200


def sections(text: str) -> list[tuple[str, list[str]]]:
    """``[(heading, prose lines)]`` of a Markdown page: split at every heading, fenced code dropped."""
    found: list[tuple[str, list[str]]] = [("(top of the page)", [])]
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            found.append((line.lstrip("#").strip(), []))
        elif not fenced:
            found[-1][1].append(line)
    return found


def word_count(text: str) -> int:
    return len(text.split())


def test_sections_and_words_are_counted_as_a_reader_sees_them():
    page = "# T\n\nfirst words here\n\n```bash\nnot prose at all\n```\n\n## Next\n\none two\n"
    counted = {h: word_count("\n".join(lines)) for h, lines in sections(page)}
    assert counted == {"(top of the page)": 0, "T": 3, "Next": 2}


@pytest.mark.parametrize("page", sorted(p.name for p in (DOCS / "howto").glob("*.md")))
def test_howto_sections_are_short_enough_to_scan(page):
    text = (DOCS / "howto" / page).read_text(encoding="utf-8")
    long = [
        f"{heading!r}: {n} words"
        for heading, lines in sections(text)
        if (n := word_count("\n".join(lines))) > HOWTO_SECTION_WORDS
    ]
    assert not long, f"docs/howto/{page}: split these sections under headings:\n" + "\n".join(long)


@pytest.mark.parametrize("page", sorted(p.name for p in (DOCS / "howto").glob("*.md")))
def test_howto_guides_open_with_their_command(page):
    """The first thing under a guide's title is the command that does the task, in a code block."""
    lines = [line for line in (DOCS / "howto" / page).read_text(encoding="utf-8").splitlines() if line.strip()]
    assert lines[0].startswith("# "), f"docs/howto/{page} does not start with its title"
    assert lines[1].startswith("```"), f"docs/howto/{page}: the line after the title is {lines[1][:80]!r}"


def test_results_are_at_most_a_quarter_of_the_site():
    pages = list(DOCS.rglob("*.md"))
    total = sum(word_count(p.read_text(encoding="utf-8")) for p in pages)
    results = sum(word_count(p.read_text(encoding="utf-8")) for p in pages if p.parent == DOCS / "results")
    assert results <= RESULTS_SHARE * total, f"results are {results} of {total} words ({results / total:.0%})"


def test_moved_pages_are_short_pointers_to_pages_that_exist():
    stubs = [p for p in (DOCS / "results").glob("*.md") if is_stub(p)]
    assert stubs
    for page in stubs:
        text = page.read_text(encoding="utf-8")
        assert word_count(text) <= STUB_WORDS, f"{page.name} is {word_count(text)} words"
        targets = re.findall(r"\]\(([^)#]+\.md)", text)
        assert targets, f"{page.name} points nowhere"
        for target in targets:
            assert (page.parent / target).resolve().is_file(), f"{page.name} points to a missing {target}"
