"""The documentation: README.md is the front door (small), docs/ holds the rest, and every link stays
inside the repository and resolves: to an existing path and, for #anchors, to a heading of the
target page (GitHub's slugs). URLs are allowed only inside code, and only to loopback addresses."""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_BYTES = 12_500
# Pages another change generates; a link to one may exist before the page does (not an #anchor into it).

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)", re.S)
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
AUTOLINK = re.compile(r"<([a-zA-Z][a-zA-Z0-9+.-]*:[^>\s]*)>")
URL = re.compile(r"\b(?:https?|ftp)://[^\s`'\"<>)\]]+", re.I)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
LOOPBACK = re.compile(r"^(?:https?|ftp)://(?:[^@/]*@)?(?:localhost|127(?:\.\d{1,3}){3}|\[::1\])(?:[:/?#]|$)", re.I)


def pages():
    return [README, *sorted(DOCS.glob("*.md"))]


def without_fences(text: str) -> str:
    """The text with fenced code blocks blanked (line count kept)."""
    out, fenced = [], False
    for line in text.split("\n"):
        if FENCE.match(line):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return "\n".join(out)


def prose(text: str) -> str:
    """Markdown outside code: no fenced blocks, no code spans."""
    return CODE_SPAN.sub(lambda m: " " * len(m.group(0)), without_fences(text))


def links(text: str) -> list[str]:
    body = prose(text)
    return [*INLINE_LINK.findall(body), *REF_DEF.findall(body), *AUTOLINK.findall(body)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lowercased, punctuation except '-' and '_'
    dropped, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in without_fences(path.read_text()).split("\n"):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def link_problems(page: Path, repo: Path = REPO) -> list[str]:
    problems = []
    text = page.read_text()
    for target in links(text):
        where = f"{page.relative_to(repo)}: ({target})"
        if not target:
            problems.append(f"{where}: empty link")
            continue
        if SCHEME.match(target) or target.startswith("//"):
            problems.append(f"{where}: points outside the repository")
            continue
        if target.startswith("/"):
            problems.append(f"{where}: absolute path; use a path relative to the page")
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page.resolve()
        if not dest.is_relative_to(repo.resolve()):
            problems.append(f"{where}: resolves outside the repository")
            continue
        if not dest.exists():
            problems.append(f"{where}: no such file")
            continue
        if anchor:
            if dest.suffix != ".md" or dest.is_dir():
                problems.append(f"{where}: an anchor into a file that is not a Markdown page")
            elif anchor not in anchors(dest):
                problems.append(f"{where}: no heading with the anchor #{anchor} in {dest.relative_to(repo.resolve())}")
    # URLs: none in prose; in code, loopback only.
    for url in URL.findall(prose(text)):
        problems.append(f"{page.relative_to(repo)}: URL outside code: {url}")
    for url in URL.findall(text):
        if not LOOPBACK.match(url):
            problems.append(f"{page.relative_to(repo)}: URL to a non-loopback address: {url}")
    return problems


def test_readme_is_the_front_door():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move detail into docs/"


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_links_resolve_and_stay_inside_the_repository(page):
    problems = link_problems(page)
    assert not problems, "\n".join(problems)


def test_every_docs_page_is_linked_from_the_readme_and_the_index():
    docs = {p.resolve() for p in DOCS.glob("*.md") if p.name != "README.md"}
    for index in (README, DOCS / "README.md"):
        linked = {(index.parent / t.partition("#")[0]).resolve() for t in links(index.read_text())
                  if not SCHEME.match(t)}
        missing = sorted(str(p.relative_to(REPO.resolve())) for p in docs - linked)
        assert not missing, f"{index.relative_to(REPO)} links to no {missing}"


def test_slugs_follow_github():
    assert slug("Performance on the GPU (H200)") == "performance-on-the-gpu-h200"
    assert slug("Images: labels, environment, runtime") == "images-labels-environment-runtime"
    assert slug("Image recipes (`images/<name>/image.yaml`)") == "image-recipes-imagesnameimageyaml"
    assert slug("tensorrt-llm and snake_case") == "tensorrt-llm-and-snake_case"


def test_the_checker_catches_broken_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Real heading\n")
    page = tmp_path / "README.md"
    page.write_text(
        "# Top\n\n"
        "[ok](docs/a.md#real-heading) [ok](#top)\n"
        "`curl http://127.0.0.1:8080/v1/x` and\n\n```sh\ncurl http://localhost:5000/v2/\n```\n"
        "[missing](docs/b.md) [bad anchor](docs/a.md#nope) [web](https://example.com/x)\n"
        "[escape](../outside.md) [abs](/etc/passwd) see http://127.0.0.1:1/ in prose\n"
        "`wget https://example.org/f` [gen anchor](docs/gen.md#x)\n")
    problems = link_problems(page, repo=tmp_path)
    text = "\n".join(problems)
    for needle in ["(docs/b.md): no such file", "#nope", "(https://example.com/x): points outside",
                   "(../outside.md): resolves outside", "(/etc/passwd): absolute path",
                   "URL outside code: http://127.0.0.1:1/", "non-loopback address: https://example.org/f",
                   "(docs/gen.md#x): no such file"]:
        assert needle in text, (needle, problems)
    assert not any("(docs/a.md#real-heading)" in p or "(#top)" in p or "(docs/gen.md)" in p for p in problems)
    assert not any("127.0.0.1:8080" in p or "localhost:5000" in p for p in problems)
