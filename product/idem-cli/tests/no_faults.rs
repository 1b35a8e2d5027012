//! The operator binary `idem` cannot be told to crash or to break a mechanism: its bytes name
//! neither fault variable (their parsing lives only in the lab binary `idem-lab`, so this holds
//! even when cargo unifies idem-core's `failpoints` feature in a workspace build), and its help
//! offers no lab command.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

/// The fault variables, spelled in pieces so that this crate's sources do not contain them.
fn fault_variables() -> [String; 2] {
    [
        ["IDEM_", "BREAK"].concat(),
        ["IDEM_", "CRASH_POINTS"].concat(),
    ]
}

#[test]
fn the_idem_binary_names_no_fault_variable() {
    let bytes = std::fs::read(env!("CARGO_BIN_EXE_idem")).unwrap();
    for name in fault_variables() {
        let found = bytes.windows(name.len()).any(|w| w == name.as_bytes());
        assert!(!found, "{name} occurs in {}", env!("CARGO_BIN_EXE_idem"));
    }
}

#[test]
fn idem_help_lists_no_lab_command() {
    let o = Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(o.status.success());
    let help = String::from_utf8_lossy(&o.stdout);
    assert!(help.contains("relay") && help.contains("migrate"), "{help}");
    let commands: Vec<&str> = help
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    for lab in [
        "demo",
        "chaos",
        "bench",
        "settlement",
        "orders",
        "points-api",
    ] {
        assert!(!commands.contains(&lab), "idem --help lists {lab}: {help}");
    }
    for lab in ["demo", "chaos", "bench", "settlement"] {
        assert!(
            !help.to_lowercase().contains(lab),
            "idem --help mentions {lab}: {help}"
        );
    }
}
