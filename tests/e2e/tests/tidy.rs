//! The tree states what is true now: code, SQL, tests and docs never narrate the project's
//! history (a review's section, an issue number, what a test did before a fix, what a name or an
//! advice "used to" be). History goes in commit bodies, `CHANGELOG.md` and the recorded runs
//! under `docs/internals/runs/`, the only files this test leaves alone.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

mod tree;

use tree::root;

/// The files whose text is checked: code, SQL, docs and configuration, outside build output,
/// the changelog and the recorded runs.
fn checked_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            let skipped =
                name == "target" || name.starts_with('.') || path.ends_with("docs/internals/runs");
            if !skipped {
                checked_files(&path, out);
            }
        } else {
            let ext = path.extension().map(|e| e.to_string_lossy().into_owned());
            let checked = matches!(
                ext.as_deref(),
                Some("rs" | "sql" | "md" | "toml" | "yml" | "yaml" | "json" | "sh" | "py")
            );
            if checked && name != "CHANGELOG.md" {
                out.push(path);
            }
        }
    }
}

/// The phrases that narrate history, each with why it is refused.
const BANNED: &[(&str, &str)] = &[
    (
        "review §",
        "names a section of a review outside the repository",
    ),
    ("of the review", "names a review outside the repository"),
    ("failed before:", "tells what a test did before a fix"),
    ("always had", "narrates a rename"),
    ("old names", "narrates a rename"),
    ("before the fix", "tells what the code did before a fix"),
];

/// The words before "used to" that make it mean "serves to", not "did once".
const USED_TO_AS_PURPOSE: &[&str] = &[
    "is", "are", "be", "been", "being", "was", "were", "get", "gets",
];

/// Where `text` narrates history: (line number, the phrase, why it is refused).
fn history(text: &str) -> Vec<(usize, String, &'static str)> {
    let mut found = vec![];
    for (i, line) in text.lines().enumerate() {
        let lower = line.to_lowercase();
        for (phrase, why) in BANNED {
            if lower.contains(phrase) {
                found.push((i + 1, (*phrase).to_owned(), *why));
            }
        }
        if let Some(n) = issue_number(&lower) {
            found.push((i + 1, format!("issue {n}"), "names an issue of the tracker"));
        }
        if section_number(&lower) {
            found.push((
                i + 1,
                "§".to_owned(),
                "names a section of a document outside the repository",
            ));
        }
        if used_to_as_past(&lower) {
            found.push((i + 1, "used to".to_owned(), "tells what something did once"));
        }
    }
    found
}

/// `issue 15`, `issue #15`, `issues 15 and 16`: a number right after the word.
fn issue_number(lower: &str) -> Option<String> {
    for (at, _) in lower.match_indices("issue") {
        let word_start = at == 0 || !lower[..at].ends_with(|c: char| c.is_ascii_alphanumeric());
        let rest = lower[at + "issue".len()..].trim_start_matches('s');
        let rest = rest.strip_prefix(' ').unwrap_or(rest);
        let rest = rest.strip_prefix('#').unwrap_or(rest);
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        if word_start && !digits.is_empty() {
            return Some(digits);
        }
    }
    None
}

/// `§3` anywhere but after an RFC's number (`RFC 8446 §4.4.2.4` names a published text).
fn section_number(lower: &str) -> bool {
    lower.match_indices('§').any(|(at, _)| {
        let numbered = lower[at + '§'.len_utf8()..].starts_with(|c: char| c.is_ascii_digit());
        let mut words = lower[..at]
            .rsplit(|c: char| !c.is_ascii_alphanumeric())
            .filter(|w| !w.is_empty());
        let rfc = words
            .next()
            .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
            && words.next() == Some("rfc");
        numbered && !rfc && !lower[..at].ends_with("review ")
    })
}

/// The word "used to" after a word that is not a form of "be" or "get" ("the lock is used to
/// serialise" and "(used to isolate)" state a purpose; "the claim used to update" narrates).
fn used_to_as_past(lower: &str) -> bool {
    lower.match_indices("used to ").any(|(at, _)| {
        if lower[..at].ends_with(|c: char| c.is_ascii_alphanumeric()) {
            return false; // "refused to", "paused to"
        }
        let before = lower[..at].trim_end();
        let word = before
            .rsplit(|c: char| !c.is_ascii_alphanumeric())
            .next()
            .unwrap_or_default();
        !word.is_empty() && !USED_TO_AS_PURPOSE.contains(&word)
    })
}

#[test]
fn no_file_narrates_history() {
    let root = root();
    let mut files = vec![];
    checked_files(&root, &mut files);
    let mut offences = vec![];
    for f in files {
        let Ok(text) = std::fs::read_to_string(&f) else {
            continue;
        };
        let rel = f.strip_prefix(&root).unwrap_or(&f).display().to_string();
        if rel == "tests/e2e/tests/tidy.rs" {
            continue;
        }
        for (line, phrase, why) in history(&text) {
            offences.push(format!("{rel}:{line}: \"{phrase}\" {why}"));
        }
    }
    assert!(
        offences.is_empty(),
        "state what is true now; history goes in the commit body or CHANGELOG.md:\n{}",
        offences.join("\n")
    );
}

#[test]
fn each_kind_of_history_is_found_and_present_tense_passes() {
    let planted = "\
-- the window is made of heads (review §3)
/// (It failed before: the keepalive confirmed the position.) It is refused to start.
// a failure, issue 15
/// §3 as reported
// the claim used to update every row
";
    let found: Vec<String> = history(planted).into_iter().map(|(_, p, _)| p).collect();
    assert_eq!(
        found,
        ["review §", "failed before:", "issue 15", "§", "used to"],
        "every planted phrase is found"
    );
    let present = "\
-- the window is made of claimable heads, so one aggregate's backoff never hides the others
/// A savepoint (used to isolate a handler) is used to isolate it; tissue 3 and reissue 4 are
/// not issues, a record paused to be read and a message that failed before the queue pass,
/// and so does RFC 8446 §4.4.2.4.
";
    assert_eq!(history(present), vec![], "present tense passes");
}

/// The folders of the library crates: a program links them and gives them their settings, so
/// their messages name settings, never the flags of idem's command line.
const LIBRARIES: &[&str] = &["core", "stores", "brokers", "engines"];

/// Where library code puts a command-line flag (`--brokers`) in a string literal, a literal
/// continued over several lines (`\` at a line's end) or a raw one included: (line, the flag).
/// Comments are skipped. A flag inside a backquoted command of another program (`` `idem
/// outbox retry --all` ``, `` `kafka-configs --alter` ``) is advice to an operator, and passes.
fn flags_in_strings(code: &str) -> Vec<(usize, String)> {
    let b = code.as_bytes();
    let (mut i, mut line, mut found) = (0, 1, vec![]);
    while i < b.len() {
        match b[i] {
            b'\n' => line += 1,
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
                continue;
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let end = block_comment_end(b, i);
                line += code[i..end].matches('\n').count();
                i = end;
                continue;
            }
            // A char literal ('"', '\'', 'é'); a lifetime or a label is not one.
            b'\'' => {
                if let Some(len) = char_literal_len(code, i) {
                    i += len;
                    continue;
                }
            }
            b'"' => {
                let hashes = raw_hashes(b, i);
                let end = literal_end(b, i + 1, hashes);
                let literal = &code[i + 1..end];
                for (at, flag) in flags_in_literal(literal) {
                    found.push((line + literal[..at].matches('\n').count(), flag));
                }
                line += literal.matches('\n').count();
                i = end + 1 + hashes.unwrap_or(0);
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    found
}

/// Where the block comment that opens at `start` (`/*`) ends, nested ones included.
fn block_comment_end(b: &[u8], start: usize) -> usize {
    let (mut depth, mut j) = (0usize, start);
    while j + 1 < b.len() {
        match (b[j], b[j + 1]) {
            (b'/', b'*') => {
                depth += 1;
                j += 2;
            }
            (b'*', b'/') => {
                depth -= 1;
                j += 2;
                if depth == 0 {
                    return j;
                }
            }
            _ => j += 1,
        }
    }
    b.len()
}

/// The length in bytes of the char literal that opens at `quote`, or `None` when the quote
/// starts a lifetime or a label.
fn char_literal_len(code: &str, quote: usize) -> Option<usize> {
    let rest = &code[quote + 1..];
    if let Some(escaped) = rest.strip_prefix('\\') {
        // '\n', '\'', '\x7f', '\u{22}': the closing quote after the escaped character.
        let first = escaped.chars().next()?.len_utf8();
        let close = escaped[first..].find('\'')?;
        return (close <= 8).then_some(1 + 1 + first + close + 1);
    }
    let c = rest.chars().next()?;
    rest[c.len_utf8()..]
        .starts_with('\'')
        .then_some(1 + c.len_utf8() + 1)
}

/// The number of `#` of a raw string whose opening quote is at `quote` (`r"…"`: 0), or `None`
/// for an ordinary string.
fn raw_hashes(b: &[u8], quote: usize) -> Option<usize> {
    let hashes = b[..quote].iter().rev().take_while(|c| **c == b'#').count();
    let r = quote.checked_sub(hashes + 1)?;
    let before = r.checked_sub(1).map(|j| b[j]);
    let starts_token =
        before.is_none_or(|c| !(c.is_ascii_alphanumeric() || c == b'_') || c == b'b');
    (b[r] == b'r' && starts_token).then_some(hashes)
}

/// Where the literal that starts at `start` ends (its closing quote).
fn literal_end(b: &[u8], start: usize, raw: Option<usize>) -> usize {
    let mut j = start;
    while j < b.len() {
        match (b[j], raw) {
            (b'\\', None) => j += 1,
            (b'"', None) => return j,
            (b'"', Some(n)) if b[j + 1..].iter().take(n).filter(|c| **c == b'#').count() == n => {
                return j;
            }
            _ => {}
        }
        j += 1;
    }
    b.len()
}

/// The flags in one literal's text, outside a backquoted command of `idem` or Kafka's tools:
/// (byte offset, flag).
fn flags_in_literal(literal: &str) -> Vec<(usize, String)> {
    let mut found = vec![];
    for (at, _) in literal.match_indices("--") {
        let after = &literal[at + 2..];
        if !after.starts_with(|c: char| c.is_ascii_lowercase()) {
            continue;
        }
        let before = &literal[..at];
        let in_command = before.matches('`').count() % 2 == 1
            && before
                .rsplit('`')
                .next()
                .is_some_and(|span| span.starts_with("idem ") || span.starts_with("kafka-"));
        if !in_command {
            let flag: String = after
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            found.push((at, format!("--{flag}")));
        }
    }
    found
}

/// The code of `text` before its unit tests (`#[cfg(test)]`), which may spell what a command
/// line prints.
fn library_code(text: &str) -> &str {
    let end = text
        .match_indices("#[cfg(test)]")
        .find(|(at, _)| text[..*at].ends_with('\n') || *at == 0)
        .map_or(text.len(), |(at, _)| at);
    &text[..end]
}

#[test]
fn no_library_message_names_a_command_line_flag() {
    let root = root();
    let mut offences = vec![];
    for lib in LIBRARIES {
        let mut files = vec![];
        checked_files(&root.join(lib), &mut files);
        for f in files.iter().filter(|f| {
            f.extension().is_some_and(|e| e == "rs")
                && f.components().any(|c| c.as_os_str() == "src")
        }) {
            let text = std::fs::read_to_string(f).unwrap();
            let rel = f.strip_prefix(&root).unwrap_or(f).display().to_string();
            for (line, flag) in flags_in_strings(library_code(&text)) {
                offences.push(format!("{rel}:{line}: {flag}"));
            }
        }
    }
    assert!(
        offences.is_empty(),
        "a library message names the setting (`security.protocol`, a config field); the command \
         line maps it to its flag:\n{}",
        offences.join("\n")
    );
}

#[test]
fn a_flag_in_a_library_string_is_found_and_an_operator_command_passes() {
    let planted = r#"    "check --brokers and that the cluster runs","#;
    assert_eq!(flags_in_strings(planted), vec![(1, "--brokers".to_owned())]);
    // On a continuation line of a literal, and in a raw string, on the line it is written on.
    let continued = "let m = format!(\n    \"give one \\\n     with --client-cert\",\n);";
    assert_eq!(
        flags_in_strings(continued),
        vec![(3, "--client-cert".to_owned())]
    );
    let raw = "let q = r#\"a \"quoted\" --slot\"#;\nlet x = '\"'; let y = \"--db\";";
    assert_eq!(
        flags_in_strings(raw),
        vec![(1, "--slot".to_owned()), (2, "--db".to_owned())]
    );
    for passes in [
        r#"    "check the brokers (`bootstrap.servers`)","#,
        r#"    format!("{note}; `idem effects retry --id {id}` sends it again"),"#,
        r#"    "set min.insync.replicas=2 (`kafka-configs --alter --entity-type topics`)","#,
        "    /// set with --brokers",
        "    let x = a--b; // \"--not-code\"",
        "    let c = '\"'; let d = a--b; let e = '\\''; f(\"fine\")",
        "    \"`idem effects dispatch --client-cert \\\n     --client-key`\"",
        "    fn f<'a>(x: &'a str) -> &'a str { 'outer: loop { break 'outer x; } }",
    ] {
        assert_eq!(flags_in_strings(passes), vec![], "{passes}");
    }
    // Past a block comment holding a quote (nested too), and a char literal of a multibyte
    // character before a quote character.
    let commented =
        "/* say \"hi /* \" */ */\nlet m = \"--missed\";\nlet c = ['é', '\"']; let d = \"--also\";";
    assert_eq!(
        flags_in_strings(commented),
        vec![(2, "--missed".to_owned()), (3, "--also".to_owned())]
    );
    let tests = "fn f() {}\n#[cfg(test)]\nmod tests { \"--flag\" }";
    assert_eq!(flags_in_strings(library_code(tests)), vec![]);
}
