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
    opening, first_block = text.split("```", 2)[:2]
    assert "./scripts/quickstart" in first_block and "./scripts/test" in first_block
    said = re.sub(r"<!--.*?-->", "", opening.split("\n", 1)[1], flags=re.S)
    assert 0 < word_count(said) <= OPENING_WORDS, f"the README says what arpo is in {word_count(said)} words"
    assert not re.search(r"\bissue \d+|/work/|\.\./shared", text, re.IGNORECASE)
    for page in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / page).is_file(), page


RESULTS_PAGES = sorted(p.name for p in (DOCS / "results").glob("*.md") if p.name != "index.md")


@pytest.mark.parametrize("page", RESULTS_PAGES)
def test_results_pages_state_date_machine_and_command(page):
    text = (DOCS / "results" / page).read_text(encoding="utf-8")
    for field in ("**Date:**", "**Machine", "**Command"):
        assert field in text, f"docs/results/{page} lacks {field}"


#: A how-to section a reader can scan: at most this many words of prose (code blocks not counted).
HOWTO_SECTION_WORDS = 400
#: Results are evidence for the rest of the site, not most of it: at most this share of the site's words.
RESULTS_SHARE = 0.25
#: The README's first words say what arpo is, before its two commands.
OPENING_WORDS = 30


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
    """The first thing under a guide's title is the command that does the task, in a code block (a docs-tier mark, an
    HTML comment a reader does not see, may precede the fence)."""
    text = (DOCS / "howto" / page).read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("<!-- docs-test: ")]
    assert lines[0].startswith("# "), f"docs/howto/{page} does not start with its title"
    assert lines[1].startswith("```"), f"docs/howto/{page}: the line after the title is {lines[1][:80]!r}"


def test_results_are_at_most_a_quarter_of_the_site():
    pages = list(DOCS.rglob("*.md"))
    total = sum(word_count(p.read_text(encoding="utf-8")) for p in pages)
    results = sum(word_count(p.read_text(encoding="utf-8")) for p in pages if p.parent == DOCS / "results")
    assert results <= RESULTS_SHARE * total, f"results are {results} of {total} words ({results / total:.0%})"


def test_no_page_only_says_it_moved():
    """Nothing released needs its old addresses kept, so a page whose content went elsewhere is deleted, not kept as a
    pointer; every page is in the nav (the strict build warns about one that is not)."""
    moved = [p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if "(moved)" in p.read_text().splitlines()[0]]
    assert not moved, f"delete these and link to where their content went: {moved}"
    assert "not_in_nav" not in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")


def paragraphs(text: str) -> list[str]:
    """The prose paragraphs of a Markdown page: split at blank lines and headings, fenced code dropped (a table is one
    paragraph)."""
    found, current, fenced = [], [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced:
            continue
        elif not line.strip() or re.match(r"#{1,6} ", line):
            if current:
                found.append("\n".join(current))
            current = []
        else:
            current.append(line)
    if current:
        found.append("\n".join(current))
    return found


#: A roadmap or changelog item: a bullet that opens with its feature's name in bold.
ITEM = re.compile(r"^\* (?:\*\*(.+?)\*\*)?", re.M)


def feature_names(page: Path) -> list[str | None]:
    """The bold names the bullets of a page open with (None for a bullet without one), lowercased, final dot dropped."""
    return [m.group(1) and m.group(1).rstrip(".").lower() for m in ITEM.finditer(page.read_text(encoding="utf-8"))]


def planned_and_shipped(roadmap: list[str], changelog: list[str]) -> list[tuple[str, str]]:
    """Pairs of a roadmap name and a changelog name where one is the other or contains it as whole words."""
    return [
        (plan, done)
        for plan in roadmap
        for done in changelog
        if re.search(rf"\b{re.escape(plan)}\b", done) or re.search(rf"\b{re.escape(done)}\b", plan)
    ]


def test_a_feature_both_planned_and_shipped_is_found(tmp_path):
    (tmp_path / "r.md").write_text("# R\n\n* **LoRA training.** Soon.\n* **A browser tool.** Later.\n")
    (tmp_path / "c.md").write_text("# C\n\n* **Stateful tools.** Done.\n* **LoRA training on vLLM.** Done.\n* plain\n")
    roadmap, changelog = feature_names(tmp_path / "r.md"), feature_names(tmp_path / "c.md")
    assert roadmap == ["lora training", "a browser tool"] and changelog[-1] is None
    assert planned_and_shipped(roadmap, changelog[:-1]) == [("lora training", "lora training on vllm")]


def test_roadmap_and_changelog_items_name_their_feature_and_none_is_both_planned_and_shipped():
    roadmap, changelog = feature_names(DOCS / "roadmap.md"), feature_names(DOCS / "changelog.md")
    assert roadmap and changelog
    assert None not in roadmap and None not in changelog, "every item opens with its feature's name in bold"
    both = planned_and_shipped(roadmap, changelog)
    assert not both, f"on the roadmap and in the changelog at once: {both}"


def title_and_answer(page: Path) -> tuple[str, str]:
    """A results page's title and its answer: the bold text its first paragraph opens with, on one line."""
    text = page.read_text(encoding="utf-8")
    title, body = text.split("\n", 1)
    answer = re.match(r"\*\*(.+?)\*\*", body.lstrip(), re.S)
    assert title.startswith("# ") and answer, f"{page.name} does not open with its title, then its answer in bold"
    return title[2:].strip(), " ".join(answer.group(1).split())


def test_results_index_gives_each_pages_title_and_bold_answer():
    rows = re.findall(r"^\| \[(.+?)\]\(([\w.-]+\.md)\) \| (.+) \|$", (DOCS / "results" / "index.md").read_text(), re.M)
    assert sorted(page for _, page, _ in rows) == RESULTS_PAGES, "one row per results page"
    wrong = [
        f"{page}: the index says {(question, answer)!r}, the page {title_and_answer(DOCS / 'results' / page)!r}"
        for question, page, answer in rows
        if (question, answer) != title_and_answer(DOCS / "results" / page)
    ]
    assert not wrong, "\n".join(wrong)


#: A figure: a number with a decimal point (0.281, 4.03, 1.64x, ± 0.261), outside inline code and link addresses.
FIGURE = re.compile(r"(?<![\w.])\d+\.\d+(?![\d.]*\d)")
#: Not figures: a paper's arXiv id and a software version (Python 3.11, Ray 2.60, torch 2.13.0).
NOT_FIGURE = re.compile(r"\b(?:arXiv|Python|python|Ray|torch|transformers|vLLM|vllm|vllm-cpu)[ =]+\d+(?:\.\d+)+")
RESULTS_LINK = re.compile(r"\]\(([\w./-]*results/[\w.-]+\.md)(?:#[\w-]*)?\)")


def unsupported_figures(document: Path, every_figure_needs_a_link: bool) -> list[str]:
    """Figures of a document's paragraphs that are not on a results page the same paragraph links to.

    A paragraph that links to results pages quotes them: each of its figures must be written, as the same number, on
    one of those pages. With ``every_figure_needs_a_link`` a figure in a paragraph without such a link is unsupported
    too (every figure of the README comes from a results page)."""
    bad = []
    for para in paragraphs(document.read_text(encoding="utf-8")):
        pages = [(document.parent / link).resolve() for link in RESULTS_LINK.findall(para)]
        prose = NOT_FIGURE.sub("", re.sub(r"`[^`]*`", "", re.sub(r"\]\([^)]*\)", "]", para)))
        figures = FIGURE.findall(prose)
        if not pages:
            bad += [
                f"{figure} (no results page linked): {para[:80]!r}" for figure in figures * every_figure_needs_a_link
            ]
            continue
        texts = [page.read_text(encoding="utf-8") if page.is_file() else "" for page in pages]
        for figure in figures:
            on_page = re.compile(rf"(?<![\d.]){re.escape(figure)}(?![\d]|\.\d)")
            if not any(on_page.search(text) for text in texts):
                bad.append(f"{figure} is on none of {[p.name for p in pages]}: {para[:80]!r}")
    return bad


def test_the_figure_check_finds_a_planted_mismatch(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "q.md").write_text("# Q\n\n**Yes: 0.725 against 0.581, 1.64x.**\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "Python 3.11 (arXiv 2507.19849): `0.5` is code.\n\n"
        "ARPO 0.725, GRPO 0.581, 1.64x as fast ([q](results/q.md)).\n\n"
        "ARPO 0.726 and GRPO 0.58 ([q](results/q.md#q)).\n\n"
        "Unlinked 0.3.\n\n```text\n9.99\n```\n"
    )
    assert unsupported_figures(doc, every_figure_needs_a_link=False) == [
        "0.726 is on none of ['q.md']: 'ARPO 0.726 and GRPO 0.58 ([q](results/q.md#q)).'",
        "0.58 is on none of ['q.md']: 'ARPO 0.726 and GRPO 0.58 ([q](results/q.md#q)).'",
    ]
    assert (
        unsupported_figures(doc, every_figure_needs_a_link=True)[-1] == "0.3 (no results page linked): 'Unlinked 0.3.'"
    )


@pytest.mark.parametrize("document, every_figure_needs_a_link", [("README.md", True), ("docs/tutorial.md", False)])
def test_figures_quoted_in_the_readme_and_tutorial_are_on_the_results_pages_they_link(
    document, every_figure_needs_a_link
):
    bad = unsupported_figures(ROOT / document, every_figure_needs_a_link)
    assert not bad, f"{document}: move each figure to its results page or quote that page's figure:\n" + "\n".join(bad)


#: A date as the results pages write one; a dated figure belongs on a results page, which says its date and machine.
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


def test_dated_figures_live_on_results_pages():
    """Outside the results pages (and the tutorial, whose figures the check above ties to them) no page is dated: a
    how-to or concept page links to the results page instead of quoting a measurement of one day."""
    dated = [
        f"{p.relative_to(DOCS).as_posix()}: {DATE.search(p.read_text(encoding='utf-8')).group(0)}"
        for p in sorted(DOCS.rglob("*.md"))
        if p.parent != DOCS / "results" and p.name != "tutorial.md" and DATE.search(p.read_text(encoding="utf-8"))
    ]
    assert not dated, "link to the results page instead:\n" + "\n".join(dated)


#: The project's own words, the glossary heading that defines each, and how a page writes it.
GLOSSARY_WORDS = {
    "room": r"\brooms?\b",
    "tier": r"\btiers?\b",
    "front-door": r"\bfront[- ]door\b",
    "fill-up": r"\bfill-ups?\b",
    "mismatch-alarm": r"\bmismatch alarm\b",
    "staleness": r"\bstaleness\b",
    "m-n-z": r"\b[MNZ] = \d|\*\*[MNZ]\*\*",
}
#: Pages whose glossary links are not checked: the reference (generated from the code), the results index (its lines
#: are the pages' titles and answers), and the architecture page, edited alongside.
GLOSSARY_EXEMPT = ("reference/", "results/index.md", "glossary.md")


def unlinked_glossary_words(page: Path) -> list[str]:
    """The glossary words a page uses without a link to their definition in or before the paragraph of first use."""
    missing = []
    paras = paragraphs(page.read_text(encoding="utf-8"))
    for anchor, pattern in GLOSSARY_WORDS.items():
        for n, para in enumerate(paras):
            prose = re.sub(r"`[^`]*`", "", re.sub(r"\]\([^)]*\)", "]", para))
            if re.search(pattern, prose):
                if not any(re.search(rf"glossary\.md#{anchor}\)", p) for p in paras[: n + 1]):
                    missing.append(f"{anchor}: {para[:80]!r}")
                break
    return missing


def test_the_glossary_defines_each_word_and_pages_link_it_where_it_first_appears():
    defined = anchors(DOCS / "glossary.md")
    assert set(GLOSSARY_WORDS) <= defined, set(GLOSSARY_WORDS) - defined
    pages = [p for p in sorted(DOCS.rglob("*.md")) if not p.relative_to(DOCS).as_posix().startswith(GLOSSARY_EXEMPT)]
    missing = [f"{p.relative_to(DOCS).as_posix()}: {m}" for p in pages for m in unlinked_glossary_words(p)]
    assert not missing, "link the word to docs/glossary.md#WORD where it first appears:\n" + "\n".join(missing)
