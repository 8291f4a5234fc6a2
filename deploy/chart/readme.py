#!/usr/bin/env python3
"""Writes helm/sleuth/README.md from the chart's values.yaml: every value
with its default and the comments above it (and after it on its line), so
the reference cannot drift from the values it describes.

    deploy/chart/readme.py          rewrite the README
    deploy/chart/readme.py --check  exit 1 if the README is out of date

Comment blocks that a blank line separates from the next key describe a
section and open it in the README."""

import pathlib
import re
import sys

CHART = pathlib.Path(__file__).resolve().parents[2] / "helm" / "sleuth"

INTRO = """# Sleuth Helm chart

Trains LLM search agents with multi-turn reinforcement learning on your own
search tools and documents, and serves them. The chart runs the rollout
orchestrator, agent workers, the tool and inference gateways, policy servers
and the learner; Redis and PostgreSQL are yours, or run in the release for a
trial (see docs/operations.md for each install scenario, upgrades and what
survives which restart).

```sh
helm install sleuth helm/sleuth --set redis.url=redis://redis-master:6379/0
```

Example values files: `values-trial.yaml` (Redis and PostgreSQL in the
release, for a first try), `values-l40s.yaml` (GPU nodes), `values-irsa.yaml` (S3
through EKS IAM roles for service accounts), `values-external-tls.yaml`
(managed Redis and PostgreSQL over TLS). `values.schema.json` refuses a wrong
type or a misspelt key, naming it.

This file is generated from `values.yaml` by `deploy/chart/readme.py`; edit
the comments there.

## Values
"""

KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.-]+):(?P<rest>.*)$")


def split_inline(rest):
    """(value, comment) of what follows `key:` on its line."""
    value, comment, quote = rest, "", None
    for i, ch in enumerate(rest):
        if ch in "\"'" and quote is None:
            quote = ch
        elif ch == quote:
            quote = None
        elif ch == "#" and quote is None and (i == 0 or rest[i - 1] == " "):
            value, comment = rest[:i], rest[i + 1 :]
            break
    return value.strip(), comment.strip()


def section(comments):
    """A section's text: its prose as a paragraph, its indented lines as a list."""
    prose = " ".join(c.strip() for c in comments if not c.startswith(" "))
    items = [f"- {' '.join(c.split())}" for c in comments if c.startswith(" ")]
    if not items:
        return prose
    # Prose after the list (its closing remark) follows it.
    first_item = next(i for i, c in enumerate(comments) if c.startswith(" "))
    before = " ".join(c.strip() for c in comments[:first_item])
    after = " ".join(c.strip() for c in comments[first_item:] if not c.startswith(" "))
    return "\n".join([before, "", *items, "", after]).strip()


def rows(lines):
    """(kind, data): ("section", text) or ("value", (path, default, description))."""
    path = []  # (indent, key)
    comments, blank_after_comments = [], False
    out = []
    for line in lines:
        stripped = line.strip()
        if not stripped:
            if comments:
                blank_after_comments = True
            continue
        if stripped.startswith("#"):
            if blank_after_comments:
                out.append(("section", section(comments)))
                comments, blank_after_comments = [], False
            text = stripped[1:]
            comments.append(text[1:] if text.startswith(" ") else text)
            continue
        match = KEY.match(line)
        if not match:
            continue  # a list item or a continuation of a value
        indent = len(match["indent"])
        while path and path[-1][0] >= indent:
            path.pop()
        path.append((indent, match["key"]))
        value, inline = split_inline(match["rest"])
        if blank_after_comments and comments:
            out.append(("section", section(comments)))
            comments = []
        description = " ".join(c.strip() for c in comments + [inline] if c.strip())
        comments, blank_after_comments = [], False
        if value == "":
            if description:
                out.append(("value", (".".join(k for _, k in path), "", description)))
            continue
        out.append(("value", (".".join(k for _, k in path), value, description)))
    return out


def escape(cell):
    """A table cell: pipes would end it."""
    return cell.replace("|", "\\|")


def render():
    lines = (CHART / "values.yaml").read_text().splitlines()
    text = [INTRO]
    table_open = False
    for kind, data in rows(lines):
        if kind == "section":
            text.append(f"\n{data}\n")
            table_open = False
            continue
        if not table_open:
            text.append("\n| value | default | description |\n|---|---|---|")
            table_open = True
        path, default, description = data
        default = escape(f"`{default}`") if default else ""
        text.append(f"| `{path}` | {default} | {escape(description)} |")
    return "\n".join(text).rstrip() + "\n"


def main():
    readme = CHART / "README.md"
    text = render()
    if "--check" in sys.argv[1:]:
        if not readme.exists() or readme.read_text() != text:
            print(f"{readme} is out of date with values.yaml: run deploy/chart/readme.py", file=sys.stderr)
            return 1
        return 0
    readme.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
