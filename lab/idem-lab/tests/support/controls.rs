//! What the negative controls' tests share.

/// Asserts that a chaos run with `--break mechanism` (its exit status, JSON report and
/// standard error) caught the broken mechanism: status 1, a failed verdict naming the control.
#[allow(dead_code)] // Not every binary that shares this module runs negative controls.
pub(crate) fn assert_caught(
    mechanism: &str,
    (code, r, stderr): (Option<i32>, &serde_json::Value, &str),
) {
    assert_eq!(
        code,
        Some(1),
        "the broken {mechanism} went unnoticed: {r:#}\n{stderr}"
    );
    assert_eq!(r["ok"], false);
    assert_eq!(r["negative_control"], mechanism);
    assert!(stderr.contains("NEGATIVE CONTROL"), "{stderr}");
}
