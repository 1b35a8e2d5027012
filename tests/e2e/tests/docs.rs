//! The documentation against the tree: every test that `docs/concepts/duplicate-windows.md`
//! names as the proof of a window exists (so the table cannot point at a test that was renamed
//! or deleted), and the README's layout block lists exactly the workspace's crates and the
//! repository's top-level folders, each of which exists; every Rust block of the README and
//! the integrating guides is compiled as a doc test of the facade.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

mod tree;

use tree::root;

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("reading {rel}: {e}"))
}

/// Every `.rs` file of the repository, outside build output.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            if name != "target" && !name.starts_with('.') {
                rust_files(&path, out);
            }
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
}

/// Every identifier in the code (comments left out) of the repository's Rust files: test
/// functions, and the names that test-stamping macros give the tests they generate.
fn identifiers() -> BTreeSet<String> {
    let mut files = vec![];
    rust_files(&root(), &mut files);
    let mut names = BTreeSet::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        for line in text.lines() {
            let code = line.split("//").next().unwrap_or_default();
            names.extend(
                code.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .filter(|w| !w.is_empty())
                    .map(str::to_owned),
            );
        }
    }
    names
}

/// The cells of every table column headed `test` or `checked by`.
fn test_cells(markdown: &str) -> Vec<String> {
    let mut cells = vec![];
    let mut column = None;
    for line in markdown.lines() {
        let Some(row) = line.trim().strip_prefix('|') else {
            column = None;
            continue;
        };
        let row: Vec<&str> = row
            .trim_end_matches('|')
            .split('|')
            .map(str::trim)
            .collect();
        if row
            .iter()
            .all(|c| c.chars().all(|ch| ch == '-' || ch == ':'))
        {
            continue;
        }
        match column {
            None => column = Some(row.iter().position(|c| *c == "test" || *c == "checked by")),
            Some(Some(i)) => cells.extend(row.get(i).map(|c| (*c).to_owned())),
            Some(None) => {}
        }
    }
    cells
}

/// Backticked test names in a cell: snake_case identifiers, where `{a,b}` stands for each
/// alternative and `*` for any text.
fn names_in(cell: &str) -> Vec<String> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .filter(|t| {
            // Test names are sentences; table and column names have fewer words.
            t.matches('_').count() >= 3
                && t.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "_*{},".contains(c))
        })
        .flat_map(expand)
        .collect()
}

fn expand(pattern: &str) -> Vec<String> {
    let (Some(open), Some(close)) = (pattern.find('{'), pattern.find('}')) else {
        return vec![pattern.to_owned()];
    };
    pattern[open + 1..close]
        .split(',')
        .flat_map(|alt| {
            expand(&format!(
                "{}{alt}{}",
                &pattern[..open],
                &pattern[close + 1..]
            ))
        })
        .collect()
}

fn matches(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == name;
    }
    let mut rest = name;
    for (i, part) in parts.iter().enumerate() {
        match rest.find(part) {
            Some(at) if i > 0 || at == 0 => rest = &rest[at + part.len()..],
            _ => return false,
        }
    }
    parts
        .last()
        .is_some_and(|p| p.is_empty() || name.ends_with(p))
}

/// Asserts that the test tables of `path` name at least `at_least` tests and that each exists.
fn assert_named_tests_exist(path: &str, at_least: usize) {
    let doc = read(path);
    let fns = identifiers();
    let named: Vec<String> = test_cells(&doc).iter().flat_map(|c| names_in(c)).collect();
    assert!(
        named.len() >= at_least,
        "found only {} test names in {path}",
        named.len()
    );
    let missing: Vec<&String> = named
        .iter()
        .filter(|n| !fns.iter().any(|f| matches(n, f)))
        .collect();
    assert!(
        missing.is_empty(),
        "{path} names tests that do not exist: {missing:?}"
    );
}

#[test]
fn every_test_the_duplicate_windows_table_names_exists() {
    assert_named_tests_exist("docs/concepts/duplicate-windows.md", 31);
}

#[test]
fn every_test_the_architecture_invariants_name_exists() {
    assert_named_tests_exist("ARCHITECTURE.md", 2);
}

#[test]
fn a_renamed_test_would_be_reported() {
    let fns = identifiers();
    // Built at run time, so that this file does not itself contain the missing name.
    let cell = format!(
        "`{}_{}` (both databases), `duplicate_event_id_is_refused`",
        "no_such_test", "exists_anywhere"
    );
    let names = names_in(&cell);
    assert_eq!(names.len(), 2);
    assert!(!fns.iter().any(|f| matches(&names[0], f)));
    assert!(fns.iter().any(|f| matches(&names[1], f)));
    assert_eq!(expand("a_{x,y}_b"), ["a_x_b", "a_y_b"]);
    assert!(matches("*_records_one", "postgres_records_one"));
    assert!(!matches("*_records_one", "postgres_records_one_more"));
}

/// The README's layout block: each line's path (its first column) and description.
fn layout() -> Vec<(String, String)> {
    let readme = read("README.md");
    let block = readme
        .split("## Layout")
        .nth(1)
        .and_then(|s| s.split("```text").nth(1))
        .and_then(|s| s.split("```").next())
        .expect("README.md has a ```text block under ## Layout");
    block
        .lines()
        .filter_map(|l| {
            let (path, text) = l
                .trim()
                .split_once(char::is_whitespace)
                .unwrap_or((l.trim(), ""));
            (!path.is_empty()).then(|| (path.trim_end_matches('/').to_owned(), text.to_owned()))
        })
        .collect()
}

#[test]
fn the_readme_layout_matches_the_tree() {
    let lines = layout();
    let listed: Vec<String> = lines.iter().map(|(p, _)| p.clone()).collect();
    for p in &listed {
        assert!(
            root().join(p).exists(),
            "README.md's layout lists {p}, which does not exist"
        );
    }
    let manifest = read("Cargo.toml");
    let members = manifest
        .split("members = [")
        .nth(1)
        .and_then(|s| s.split(']').next())
        .expect("the workspace lists its members");
    for member in members
        .split(',')
        .map(|m| m.trim().trim_matches('"'))
        .filter(|m| !m.is_empty())
    {
        // Listed by its path, or named on the line of the folder that holds it (examples/).
        let (parent, name) = member.rsplit_once('/').unwrap_or(("", member));
        assert!(
            lines
                .iter()
                .any(|(p, text)| p == member || (p == parent && text.contains(name))),
            "README.md's layout does not list the workspace member {member}"
        );
    }
    for entry in std::fs::read_dir(root()).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() && !name.starts_with('.') && name != "target" {
            assert!(
                listed
                    .iter()
                    .any(|p| p == &name || p.starts_with(&format!("{name}/"))),
                "README.md's layout does not mention the folder {name}/"
            );
        }
    }
}

/// The shell block of `markdown` that follows the line starting with `after`, its
/// continuation lines (`\\` at the end) joined and comments dropped.
fn shell_block(markdown: &str, after: &str) -> Vec<String> {
    let start = markdown
        .find(after)
        .unwrap_or_else(|| panic!("no {after:?}"));
    let rest = &markdown[start..];
    let body = rest
        .split("```sh\n")
        .nth(1)
        .unwrap()
        .split("```")
        .next()
        .unwrap();
    joined_lines(body)
}

/// `text`'s lines with continuations joined and `#` comments dropped.
fn joined_lines(text: &str) -> Vec<String> {
    let mut out = vec![];
    let mut line = String::new();
    for l in text.lines() {
        let l = l.split(" #").next().unwrap().trim_end();
        match l.strip_suffix('\\') {
            Some(head) => line.push_str(head),
            None => {
                line.push_str(l);
                out.push(std::mem::take(&mut line).trim().to_owned());
            }
        }
    }
    out
}

/// A command line as (program and subcommands, flags): `idem-lab settlement --db X --brokers
/// Y &` is (`idem-lab settlement`, [`--brokers`, `--db`]).
fn command_of(line: &str) -> Option<(String, BTreeSet<String>)> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let at = words
        .iter()
        .position(|w| *w == "idem" || *w == "idem-lab")?;
    let words = &words[at..];
    let name: Vec<&str> = words
        .iter()
        .take_while(|w| !w.starts_with('-'))
        .copied()
        .collect();
    let flags = words
        .iter()
        .filter(|w| w.starts_with("--"))
        .map(|w| w.to_string())
        .collect();
    Some((name.join(" ").trim_end_matches(" &").to_owned(), flags))
}

/// The README's reference chain is what `scripts/reference-chain` runs (and CI with it): each
/// `idem`/`idem-lab` command the README shows is in the script with the same subcommand and
/// flags, so the chain a newcomer copies is the one that is tested.
#[test]
fn the_readme_reference_chain_is_the_one_the_script_runs() {
    let readme = shell_block(&read("README.md"), "The whole reference chain");
    let script: Vec<(String, BTreeSet<String>)> = joined_lines(&read("scripts/reference-chain"))
        .iter()
        .filter_map(|l| command_of(l))
        .collect();
    let mut checked = 0;
    for line in &readme {
        let Some((name, flags)) = command_of(line) else {
            continue;
        };
        checked += 1;
        assert!(
            script.iter().any(|(n, f)| *n == name && flags.is_subset(f)),
            "README runs `{line}`; scripts/reference-chain has no `{name}` with {flags:?}"
        );
    }
    assert!(
        checked >= 10,
        "only {checked} commands in the README's chain"
    );
}

/// The Rust blocks of a markdown file that are not compiled: `rust,ignore` (and `ignore`
/// among other attributes); `rust`, `rust,no_run` and `rust,should_panic` compile.
fn uncompiled_rust_blocks(markdown: &str) -> Vec<String> {
    markdown
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("```rust"))
        .filter(|info| info.split(',').any(|a| a.trim() == "ignore"))
        .map(|info| format!("```rust{info}"))
        .collect()
}

/// The integrating guides and the README are the facade's doc tests: each guide is included
/// by `product/idem/src/lib.rs` (the README is its crate documentation), and none of their
/// Rust blocks is `ignore`d, so every example a user copies compiles against the API.
#[test]
fn every_rust_block_of_the_guides_and_the_readme_compiles_as_a_doc_test() {
    let facade = read("product/idem/src/lib.rs");
    assert!(facade.contains("include_str!(\"../../../README.md\")"));
    let mut guides = vec![];
    for entry in std::fs::read_dir(root().join("docs/integrating")).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        if name.ends_with(".md") {
            guides.push(format!("docs/integrating/{name}"));
        }
    }
    assert!(guides.len() >= 5, "{guides:?}");
    for guide in &guides {
        assert!(
            facade.contains(&format!("include_str!(\"../../../{guide}\")")),
            "{guide} is not included as doc tests by product/idem/src/lib.rs"
        );
    }
    for file in guides.iter().map(String::as_str).chain(["README.md"]) {
        let ignored = uncompiled_rust_blocks(&read(file));
        assert!(
            ignored.is_empty(),
            "{file} has Rust blocks not compiled: {ignored:?}"
        );
    }
}

#[test]
fn an_ignored_rust_block_is_found() {
    let md = "text\n```rust,ignore\nlet x = 1;\n```\n```rust,no_run\nfn f() {}\n```\n```sql\nSELECT 1;\n```\n";
    assert_eq!(uncompiled_rust_blocks(md), ["```rust,ignore"]);
}

#[test]
fn every_crash_point_and_negative_control_is_documented() {
    let crash_doc = read("docs/reference/crash-points.md");
    let windows = read("docs/concepts/duplicate-windows.md");
    for point in idem_core::crash::CrashPoint::ALL.iter().map(|p| p.as_str()) {
        assert!(
            crash_doc.contains(point),
            "docs/reference/crash-points.md does not list {point}"
        );
        assert!(
            windows.contains(point),
            "docs/concepts/duplicate-windows.md has no window for {point}"
        );
    }
    let lab = read("docs/internals/demo-and-chaos.md");
    for control in idem_core::crash::Mechanism::ALL {
        assert!(
            lab.contains(&format!("`{control}`")),
            "docs/internals/demo-and-chaos.md does not describe the negative control {control}"
        );
    }
}

/// The variant name of a crash point's name: `relay.after_claim` is `RelayAfterClaim`.
fn camel_case(name: &str) -> String {
    name.split(['.', '_'])
        .flat_map(|word| {
            let mut c = word.chars();
            c.next()
                .map(|first| first.to_ascii_uppercase())
                .into_iter()
                .chain(c)
        })
        .collect()
}

/// Each row of the crash points' table names the file (and the function, where it names one)
/// that fires the point: the file calls `crash_point` with the point's variant.
#[test]
fn every_crash_point_is_fired_where_its_row_says() {
    let doc = read("docs/reference/crash-points.md");
    let mut rows = 0;
    for line in doc.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = line.split(" | ").collect();
        let point = cells[0].trim_start_matches("| ").trim_matches('`');
        if !point.contains('.') || cells.len() < 2 {
            continue;
        }
        let quoted: Vec<&str> = cells[1].split('`').skip(1).step_by(2).collect();
        let file = quoted[0];
        let code = read(file);
        if let Err(e) = point.parse::<idem_core::crash::CrashPoint>() {
            panic!("docs/reference/crash-points.md: {e}");
        }
        let variant = format!("CrashPoint::{}", camel_case(point));
        assert!(
            code.contains("crash_point(") && code.contains(&variant),
            "{point}: {file} does not fire {variant}"
        );
        if let Some(function) = quoted.get(1).and_then(|f| f.rsplit("::").next()) {
            assert!(
                code.contains(&format!("fn {function}(")),
                "{point}: {file} has no function {function}"
            );
        }
        rows += 1;
    }
    assert_eq!(
        rows,
        idem_core::crash::CrashPoint::ALL.len(),
        "one row per crash point"
    );
}
