"""Every ```cpp block of docs/*.md (and of README.md after its first, which the readme_example test compiles) stands
line for line in test/docs_code.cpp (the MLflow logger's in test/mlflow.cpp), which the test suite compiles and runs: the guides' code is compiled code.

    python3 docs_check.py <repository root>

Lines compare without their indentation; blank lines and #include lines (at the top of the compiled file) are left
out. Prints "docs code ok: N blocks" or names each block that is not there, by page and line.
"""

import glob
import os
import sys

root = sys.argv[1]


def code_lines(text):
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#include")]


def blocks(path):
    out, block, start = [], None, 0
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if block is None and line.startswith("```cpp"):
                block, start = [], n
            elif block is not None and line.startswith("```"):
                out.append((start, code_lines("\n".join(block))))
                block = None
            elif block is not None:
                block.append(line.rstrip("\n"))
    return out


# test/mlflow.cpp holds the MLflow logger's block: it links libcurl, which the other tests do not.
compiled = [code_lines(open(os.path.join(root, "test", f)).read()) for f in ("docs_code.cpp", "mlflow.cpp")]


def contains(haystack, needle):
    return any(haystack[i:i + len(needle)] == needle for i in range(len(haystack) - len(needle) + 1))


pages = sorted(glob.glob(os.path.join(root, "docs", "*.md")))
checked, missing = 0, []
for page in pages + [os.path.join(root, "README.md")]:
    found = blocks(page)
    if page.endswith("README.md"):
        found = found[1:]
    for line, block in found:
        checked += 1
        if not any(contains(c, block) for c in compiled):
            missing.append(f"{os.path.relpath(page, root)}:{line}")
if missing:
    print("not in test/docs_code.cpp (copy the block there, with what it needs around it): " + ", ".join(missing))
    sys.exit(1)
print(f"docs code ok: {checked} blocks")
