//! Where `idem`'s settings come from, as a process sees them: a value from an `IDEM_…_FILE`
//! file or the `--settings` file, the command line winning over both, and secrets kept out of
//! every `--help` and message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::{Command, Output};

fn idem(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem"));
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn all_text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The subcommands `idem <path> --help` lists.
fn subcommands(path: &[String]) -> Vec<String> {
    let args: Vec<&str> = path.iter().map(String::as_str).chain(["--help"]).collect();
    let help = all_text(&idem(&args, &[]));
    help.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_owned)
        .collect()
}

/// Every command path of `idem`, leaves and groups.
fn every_command() -> Vec<Vec<String>> {
    let mut out = vec![vec![]];
    let mut i = 0;
    while i < out.len() {
        let path = out[i].clone();
        for c in subcommands(&path) {
            let mut p = path.clone();
            p.push(c);
            out.push(p);
        }
        i += 1;
    }
    out
}

const SECRETS: &[(&str, &str)] = &[
    ("IDEM_DB", "postgres://relay:hunter2-db@db.example/shop"),
    ("IDEM_KAFKA_SASL_PASSWORD", "hunter2-kafka"),
    ("IDEM_EFFECTS_AUTHORIZATION", "Bearer hunter2-auth"),
    ("IDEM_KAFKA_OAUTH_CLIENT_SECRET", "hunter2-oidc"),
];

#[test]
fn no_help_of_any_command_shows_a_secret_set_in_the_environment() {
    let commands = every_command();
    assert!(commands.len() > 15, "too few commands found: {commands:?}");
    let mut with_env = 0;
    for path in &commands {
        let args: Vec<&str> = path.iter().map(String::as_str).chain(["--help"]).collect();
        let out = all_text(&idem(&args, SECRETS));
        assert!(
            !out.contains("hunter2"),
            "idem {path:?} --help shows a secret:\n{out}"
        );
        with_env += usize::from(out.contains("[env: IDEM_DB]"));
    }
    assert!(
        with_env > 5,
        "the variables themselves are listed ({with_env} commands)"
    );
}

fn sqlite_url(dir: &Path, name: &str) -> String {
    format!("sqlite://{}", dir.join(name).display())
}

fn migrated(dir: &Path, name: &str) -> bool {
    dir.join(name).exists()
}

#[test]
fn a_value_comes_from_a_file_or_the_settings_and_the_command_line_wins() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // IDEM_DB_FILE: the URL from a file (with the newline an editor leaves).
    let secret = d.join("db-url");
    std::fs::write(&secret, format!("{}\n", sqlite_url(d, "from-file.db"))).unwrap();
    let o = idem(&["migrate"], &[("IDEM_DB_FILE", secret.to_str().unwrap())]);
    assert!(o.status.success(), "{}", all_text(&o));
    assert!(migrated(d, "from-file.db"));

    // --settings: below the environment, above the default.
    let config = d.join("migrate.toml");
    std::fs::write(
        &config,
        format!("db = {:?}\n", sqlite_url(d, "from-config.db")),
    )
    .unwrap();
    let cfg = config.to_str().unwrap();
    let o = idem(&["migrate", "--settings", cfg], &[]);
    assert!(o.status.success(), "{}", all_text(&o));
    assert!(migrated(d, "from-config.db"));
    let o = idem(
        &["migrate"],
        &[
            ("IDEM_SETTINGS", cfg),
            ("IDEM_DB", &sqlite_url(d, "from-env.db")),
        ],
    );
    assert!(o.status.success(), "{}", all_text(&o));
    assert!(
        migrated(d, "from-env.db"),
        "the environment outranks the settings file"
    );

    // The command line outranks both.
    let url = sqlite_url(d, "from-cli.db");
    let o = idem(
        &["migrate", "--settings", cfg, "--db", &url],
        &[("IDEM_DB_FILE", secret.to_str().unwrap())],
    );
    assert!(o.status.success(), "{}", all_text(&o));
    assert!(migrated(d, "from-cli.db"));

    // A key the command does not have is refused, naming it.
    std::fs::write(&config, "db = \"sqlite://x.db\"\nbrokers = \"b:9092\"\n").unwrap();
    let o = idem(&["migrate", "--settings", cfg], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        all_text(&o).contains("sets `brokers`, which is not a flag of `migrate`"),
        "{}",
        all_text(&o)
    );
}

#[test]
fn a_password_given_as_a_url_parameter_never_reaches_a_message() {
    // Port 1 on loopback: nothing listens, the connection is refused at once.
    let o = idem(
        &[
            "outbox",
            "status",
            "--db",
            "postgres://relay@127.0.0.1:1/shop?sslmode=disable&password=hunter2-param",
        ],
        &[],
    );
    let out = all_text(&o);
    assert!(!o.status.success());
    assert!(!out.contains("hunter2"), "{out}");
    assert!(
        out.contains("password=***"),
        "the URL is shown, redacted: {out}"
    );
}
