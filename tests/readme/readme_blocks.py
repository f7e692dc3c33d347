#!/usr/bin/env python3
"""Pulls the fenced code blocks of one language out of a Markdown file, one file per block.

    readme_blocks.py [--lang cpp|python] [--prelude FILE] --out DIR README.md

Writes DIR/block_LINE.EXT for every ```cpp (or ```python) block, LINE being the line of its
opening fence (DIR/NAME for a file=NAME block), and prints the paths written, one a line. Standard library only, so that any
python3 runs it (tests/readme/check_readme_cpp.sh for the C++ blocks; the Python suite can run or
import it for the Python blocks).

How a block is compiled is said by an HTML comment on the last non-blank line before its fence
(invisible on GitHub), one or more of these words:

    <!-- README-test: fragment -->    the block is statements, not a whole file
    <!-- README-test: continues -->   the block goes on from the previous block of its language
    <!-- README-test: file=NAME -->   the block is the whole file NAME of a program the README
                                      tells the reader to save and run (engine.py and trainer.py
                                      of the two-process example): written as DIR/NAME, as it is,
                                      for a test that runs it as the README says

- No comment: the block is a whole translation unit (or script) and is written as it is.
- fragment: the --prelude file, which declares the placeholders README blocks use for what a real
  worker has (my_model_parameters(), my_cuda_stream(), ...), comes before the block. In C++ the
  block's #include lines stay at file scope, then the prelude is #included, and every other line
  becomes the body of a function `void readme_block_LINE()`; a placeholder is declared there, never
  removed from the README. In Python the prelude's text is put in front of the block.
- continues: the block is appended to the previous block of the same language (into the same C++
  function body: a variable of the earlier block is still in scope), and no file of its own is
  written.

C++ output carries #line directives, so a compiler's diagnostics name README.md and its lines;
Python output starts with a `# README.md:LINE` comment. An unknown word in a README-test comment,
or a comment not followed by a fence, is an error (exit 2): a typo must not silently skip a check.
"""

import argparse
import os
import re
import sys

LANGS = {  # info-string word -> (language, file extension)
    'cpp': ('cpp', 'cpp'), 'c++': ('cpp', 'cpp'), 'cxx': ('cpp', 'cpp'),
    'python': ('python', 'py'), 'py': ('python', 'py'),
    'sh': ('sh', 'sh'), 'bash': ('sh', 'sh'),  # only file=NAME blocks are written (the install lines)
}
MODES = {'fragment', 'continues'}
FILE_NAME = re.compile(r'^file=([A-Za-z0-9_.-]+)$')
ANNOTATION = re.compile(r'^\s*<!--\s*README-test:(.*?)-->\s*$')
FENCE = re.compile(r'^ {0,3}(`{3,})\s*([^`\s]*)')
INCLUDE = re.compile(r'^\s*#\s*include\b')


class ReadmeError(Exception):
    pass


class Block:
    def __init__(self, path, line, lang, modes, lines, file=None):
        self.path, self.line, self.lang, self.modes = path, line, lang, modes
        self.lines = lines  # [(README line number, text)]
        self.file = file    # NAME of file=NAME, else None


def parse(path):
    """The fenced blocks of `path` with a known language, in order, with their README-test modes."""
    with open(path, encoding='utf-8') as f:
        text = f.read().splitlines()
    blocks, pending, i = [], None, 0   # pending: (line, modes) of a README-test comment
    while i < len(text):
        line = text[i]
        m = ANNOTATION.match(line)
        if m:
            modes = set(m.group(1).replace(',', ' ').split())
            files = {w for w in modes if FILE_NAME.match(w)}
            unknown = modes - MODES - files
            if unknown or not modes or len(files) > 1 or (files and modes - files):
                raise ReadmeError(f'{path}:{i + 1}: README-test comment with unknown or no words '
                                  f'{sorted(unknown)} (known: {sorted(MODES)}, or file=NAME alone)')
            pending = (i + 1, modes)
            i += 1
            continue
        m = FENCE.match(line)
        if not m:
            if pending and line.strip():
                raise ReadmeError(f'{path}:{pending[0]}: README-test comment not followed by a code block')
            i += 1
            continue
        fence, info, start = m.group(1), m.group(2).lower(), i + 1
        body, i = [], i + 1
        while i < len(text) and not re.match(r'^ {0,3}' + fence + r'`*\s*$', text[i]):
            body.append((i + 1, text[i]))
            i += 1
        if i == len(text):
            raise ReadmeError(f'{path}:{start}: code block never closed')
        i += 1  # the closing fence
        modes = pending[1] if pending else set()
        pending = None
        if info in LANGS:
            named = [FILE_NAME.match(w).group(1) for w in modes if FILE_NAME.match(w)]
            blocks.append(Block(path, start, LANGS[info][0], modes - {f'file={n}' for n in named}, body,
                                named[0] if named else None))
        elif modes:
            raise ReadmeError(f'{path}:{start}: README-test comment on a block of language '
                              f'"{info}" (known: {sorted(LANGS)})')
    if pending:
        raise ReadmeError(f'{path}:{pending[0]}: README-test comment not followed by a code block')
    return blocks


def group(blocks, lang):
    """Blocks of `lang`, each with the blocks that continue it: [[first, continuation, ...], ...]."""
    groups = []
    for b in (b for b in blocks if b.lang == lang):
        if b.file is not None:
            if any(g[0].file == b.file for g in groups):
                raise ReadmeError(f'{b.path}:{b.line}: a second block for file={b.file}')
            groups.append([b])
        elif 'continues' in b.modes:
            if not groups:
                raise ReadmeError(f'{b.path}:{b.line}: "continues" but no earlier {lang} block')
            groups[-1].append(b)
        else:
            groups.append([b])
    return groups


def numbered(lines, name):
    """Lines of the README with a #line directive wherever they do not follow one another."""
    out, last = [], None
    for n, t in lines:
        if last is None or n != last + 1:
            out.append(f'#line {n} "{name}"')
        out.append(t)
        last = n
    return out


def render_cpp(blocks, prelude):
    """One translation unit from a block and its continuations."""
    first, name = blocks[0], blocks[0].path
    out = [f'// {name}:{first.line}, written by tests/readme/readme_blocks.py']
    lines = [line for b in blocks for line in b.lines]
    if 'fragment' not in first.modes:
        return '\n'.join(out + numbered(lines, name)) + '\n'
    out += numbered([(n, t) for n, t in lines if INCLUDE.match(t)], name)
    if prelude is not None:
        out.append(f'#include "{os.path.abspath(prelude)}"')
    out += [f'void readme_block_{first.line}() {{']
    out += numbered([(n, t) for n, t in lines if not INCLUDE.match(t)], name)
    return '\n'.join(out + ['}']) + '\n'


def render_python(blocks, prelude):
    first = blocks[0]
    if first.file is not None:  # a program the reader saves: exactly the README's text
        return '\n'.join(t for _, t in first.lines) + '\n'

    out = [f'# {first.path}:{first.line}, written by tests/readme/readme_blocks.py']
    if 'fragment' in first.modes and prelude is not None:
        with open(prelude, encoding='utf-8') as f:
            out += f.read().splitlines()
    for b in blocks:
        out += [f'# {b.path}:{b.line}'] + [t for _, t in b.lines]
    return '\n'.join(out) + '\n'


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('readme')
    ap.add_argument('--lang', choices=['cpp', 'python', 'sh'], default='cpp')
    ap.add_argument('--prelude', help='file put before every fragment block')
    ap.add_argument('--out', required=True, help='directory for block_LINE.cpp / .py')
    args = ap.parse_args(argv)
    try:
        groups = group(parse(args.readme), args.lang)
    except ReadmeError as e:
        print(f'readme_blocks.py: {e}', file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    render, ext = {'cpp': (render_cpp, 'cpp'), 'python': (render_python, 'py'),
                   'sh': (lambda blocks, _: '\n'.join(t for _, t in blocks[0].lines) + '\n', 'sh')}[args.lang]
    for blocks in groups:
        if args.lang == 'sh' and blocks[0].file is None:
            continue  # a shell block the reader types is an example; file=NAME ones are run
        name = blocks[0].file or f'block_{blocks[0].line}.{ext}'
        path = os.path.join(args.out, name)
        with open(path, 'w', encoding='utf-8') as f:
            f.write(render(blocks, args.prelude))
        print(path)
    return 0


if __name__ == '__main__':
    sys.exit(main())
