//! Where a flag's value comes from, by one precedence rule:
//!
//! 1. the command line (`--db …`);
//! 2. the environment: `IDEM_<FLAG>` (`--metrics-addr` reads `IDEM_METRICS_ADDR`), or
//!    `IDEM_<FLAG>_FILE`, the path of a file holding the value (how container platforms mount
//!    secrets; one trailing newline is dropped). Setting both is refused;
//! 3. the settings file, `--settings FILE` or `IDEM_SETTINGS`: TOML, one `flag-name = value` per flag
//!    of the command that runs (a list for a repeated flag, `true` for a switch); a key that is
//!    not a flag of that command is refused;
//! 4. the flag's default.
//!
//! Every flag gets its environment variable here (flags that name one keep theirs), and no
//! `--help` shows an environment variable's value: a secret set there never reaches the help.
//! A repeated flag (`--topic`, `--producer-config`) takes the values of every source that gives
//! it, the settings file's first.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::{Arg, ArgAction, Command};

/// The root command's `--settings` (not `--config`: `idem verify --config` is the verify
/// config).
const CONFIG: &str = "settings";
/// The root command's `--log-format`.
const LOG_FORMAT: &str = "log-format";

/// How log lines are written to standard error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event.
    Text,
    /// One JSON object per event and line: time, level, target, message, fields, and the
    /// spans it happened in (a consumer's `idem.handle` span carries the event's `trace_id`).
    Json,
}

/// Parses the process's command line with `cmd` under this module's rules; exits with the
/// message (status 2) on a command line, an environment or a settings file that cannot be used.
pub fn matches(cmd: Command) -> (clap::ArgMatches, LogFormat) {
    let cmd = command(cmd);
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let args = match argv(&cmd, std::env::args_os().collect(), &env) {
        Ok(args) => args,
        Err(e) => {
            eprintln!("{}: error: {e:#}", cmd.get_name());
            std::process::exit(2);
        }
    };
    let m = cmd.get_matches_from(args);
    let log = m
        .get_one::<LogFormat>(LOG_FORMAT)
        .copied()
        .unwrap_or(LogFormat::Text);
    (m, log)
}

/// `cmd` with an environment variable for every flag, no value shown in any help, later
/// occurrences of a flag overriding earlier ones (how the command line outranks the settings
/// file), and the global `--settings FILE`.
pub fn command(cmd: Command) -> Command {
    with_env(cmd).arg(
        Arg::new(CONFIG)
            .long(CONFIG)
            .global(true)
            .value_name("FILE")
            .env("IDEM_SETTINGS")
            .help("TOML file of flag values (`flag-name = value`): below the command line and the environment"),
    )
    .arg(
        Arg::new(LOG_FORMAT)
            .long(LOG_FORMAT)
            .global(true)
            .value_parser(clap::value_parser!(LogFormat))
            .default_value("text")
            .env("IDEM_LOG_FORMAT")
            .help("How log lines are written to standard error"),
    )
}

fn with_env(cmd: Command) -> Command {
    cmd.args_override_self(true)
        .mut_args(|a| {
            let a = a.hide_env_values(true);
            match (a.get_env(), a.get_long()) {
                (None, Some(long)) if long != "help" && long != "version" => {
                    let name: &'static str = Box::leak(env_name(long).into_boxed_str());
                    a.env(name)
                }
                _ => a,
            }
        })
        .mut_subcommands(with_env)
}

/// `IDEM_<FLAG>` for `--flag-name`.
pub fn env_name(long: &str) -> String {
    format!("IDEM_{}", long.to_ascii_uppercase().replace('-', "_"))
}

/// The command line to parse: `args` with the values of `IDEM_…_FILE` files and of the config
/// file put before the flags the user wrote (so that theirs win), right after the subcommand
/// that runs. `env` reads the environment.
pub fn argv(
    cmd: &Command,
    args: Vec<OsString>,
    env: &dyn Fn(&str) -> Option<String>,
) -> anyhow::Result<Vec<OsString>> {
    let (leaf, at) = leaf(cmd, &args);
    let mut injected = Vec::new();
    if let Some(path) = config_path(&args, env) {
        injected.extend(from_config(leaf, &path, env)?);
    }
    injected.extend(from_files(leaf, env)?);
    let mut out: Vec<OsString> = args[..at].to_vec();
    out.extend(injected.into_iter().map(OsString::from));
    out.extend_from_slice(&args[at..]);
    Ok(out)
}

/// The subcommand that runs and the index in `args` just after its name (global flags written
/// before a subcommand's name are stepped over).
fn leaf<'c>(cmd: &'c Command, args: &[OsString]) -> (&'c Command, usize) {
    let (mut cur, mut at, mut after) = (cmd, 1, 1);
    while let Some(token) = args.get(at).and_then(|a| a.to_str()) {
        if let Some(next) = cur.find_subcommand(token) {
            cur = next;
            at += 1;
            after = at;
        } else if [CONFIG, LOG_FORMAT]
            .iter()
            .any(|g| token == format!("--{g}"))
        {
            at += 2;
        } else if [CONFIG, LOG_FORMAT]
            .iter()
            .any(|g| token.starts_with(&format!("--{g}=")))
        {
            at += 1;
        } else {
            break;
        }
    }
    (cur, after.min(args.len()))
}

fn config_path(args: &[OsString], env: &dyn Fn(&str) -> Option<String>) -> Option<PathBuf> {
    let mut it = args.iter().filter_map(|a| a.to_str());
    while let Some(a) = it.next() {
        if a == "--settings" {
            return it.next().map(PathBuf::from);
        }
        if let Some(v) = a.strip_prefix("--settings=") {
            return Some(PathBuf::from(v));
        }
    }
    env("IDEM_SETTINGS").map(PathBuf::from)
}

/// Whether the environment sets `arg` (its variable, or that variable's `_FILE`).
fn set_by_env(arg: &Arg, env: &dyn Fn(&str) -> Option<String>) -> bool {
    arg.get_env()
        .and_then(|e| e.to_str())
        .is_some_and(|name| env(name).is_some() || env(&format!("{name}_FILE")).is_some())
}

/// The flag of `leaf` named `key` (`metrics-addr` or `metrics_addr`).
fn flag<'c>(leaf: &'c Command, key: &str) -> Option<&'c Arg> {
    let long = key.replace('_', "-");
    leaf.get_arguments()
        .find(|a| a.get_long() == Some(long.as_str()) && long != CONFIG)
}

fn from_config(
    leaf: &Command,
    path: &Path,
    env: &dyn Fn(&str) -> Option<String>,
) -> anyhow::Result<Vec<String>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the settings file {}", path.display()))?;
    let table: toml::Table = toml::from_str(&text)
        .with_context(|| format!("the settings file {} is not TOML", path.display()))?;
    let mut out = Vec::new();
    for (key, value) in &table {
        let Some(arg) = flag(leaf, key) else {
            bail!(
                "the settings file {} sets `{key}`, which is not a flag of `{}`: remove it, or \
                 keep one file per command (`{} --help` lists its flags)",
                path.display(),
                leaf.get_name(),
                leaf.get_name()
            );
        };
        if set_by_env(arg, env) {
            continue;
        }
        out.extend(values(arg, key, value, path)?);
    }
    Ok(out)
}

/// `--flag=value` for each value (`--flag` alone for a switch set to `true`).
fn values(arg: &Arg, key: &str, value: &toml::Value, path: &Path) -> anyhow::Result<Vec<String>> {
    let long = arg.get_long().unwrap_or(key);
    let switch = !arg.get_action().takes_values();
    let items: Vec<&toml::Value> = match value {
        toml::Value::Array(items) if matches!(arg.get_action(), ArgAction::Append) => {
            items.iter().collect()
        }
        other => vec![other],
    };
    let mut out = Vec::new();
    for v in items {
        let text = match v {
            toml::Value::String(s) => s.clone(),
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Float(f) => f.to_string(),
            toml::Value::Boolean(b) if switch => {
                if *b {
                    out.push(format!("--{long}"));
                }
                continue;
            }
            toml::Value::Boolean(b) => b.to_string(),
            _ => bail!(
                "the settings file {} gives `{key}` a {}: use a string, a number, a boolean \
                 or a list of those for a repeated flag",
                path.display(),
                v.type_str()
            ),
        };
        if switch {
            bail!(
                "the settings file {} gives the switch `{key}` {text:?}: use true or false",
                path.display()
            );
        }
        out.push(format!("--{long}={text}"));
    }
    Ok(out)
}

/// `--flag=<contents>` for every flag whose `IDEM_<FLAG>_FILE` is set (unless the command has a
/// flag of its own reading that variable).
fn from_files(leaf: &Command, env: &dyn Fn(&str) -> Option<String>) -> anyhow::Result<Vec<String>> {
    let taken: Vec<&str> = leaf
        .get_arguments()
        .filter_map(|a| a.get_env().and_then(|e| e.to_str()))
        .collect();
    let mut out = Vec::new();
    for arg in leaf.get_arguments() {
        let (Some(name), Some(long)) = (arg.get_env().and_then(|e| e.to_str()), arg.get_long())
        else {
            continue;
        };
        let file_var = format!("{name}_FILE");
        if taken.contains(&file_var.as_str()) || !arg.get_action().takes_values() {
            continue;
        }
        let Some(path) = env(&file_var) else { continue };
        if env(name).is_some() {
            bail!("both {name} and {file_var} are set: keep one");
        }
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("{file_var}={path} cannot be read"))?;
        let text = text
            .strip_suffix('\n')
            .map(|t| t.strip_suffix('\r').unwrap_or(t))
            .unwrap_or(&text);
        out.push(format!("--{long}={text}"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cli() -> Command {
        command(
            Command::new("idem").subcommand(
                Command::new("relay")
                    .arg(Arg::new("db").long("db").required(true))
                    .arg(Arg::new("metrics-addr").long("metrics-addr"))
                    .arg(Arg::new("topic").long("topic").action(ArgAction::Append))
                    .arg(
                        Arg::new("create-topics")
                            .long("create-topics")
                            .action(ArgAction::SetTrue),
                    )
                    .arg(
                        Arg::new("authorization")
                            .long("authorization")
                            .env("IDEM_EFFECTS_AUTHORIZATION"),
                    ),
            ),
        )
    }

    fn os(args: &[&str]) -> Vec<OsString> {
        args.iter().map(OsString::from).collect()
    }

    fn run(args: &[&str], vars: &[(&str, &str)]) -> anyhow::Result<clap::ArgMatches> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let env = |k: &str| vars.get(k).cloned();
        let cmd = cli();
        let argv = argv(&cmd, os(args), &env)?;
        // clap reads the real environment for IDEM_… variables; the tests set none of those it
        // would read, and check what the composed command line alone gives.
        Ok(cmd.try_get_matches_from(argv)?)
    }

    fn relay(m: &clap::ArgMatches) -> &clap::ArgMatches {
        m.subcommand_matches("relay")
            .unwrap_or_else(|| panic!("no relay"))
    }

    fn config(text: &str) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(f.path(), text).unwrap_or_else(|e| panic!("{e}"));
        f
    }

    fn get<'m>(m: &'m clap::ArgMatches, id: &str) -> Option<&'m String> {
        m.get_one::<String>(id)
    }

    #[test]
    fn every_flag_reads_idem_flag_and_no_help_shows_a_value() {
        let mut cmd = cli();
        let relay = cmd
            .find_subcommand_mut("relay")
            .unwrap_or_else(|| panic!("no relay"));
        let envs: Vec<(String, bool)> = relay
            .get_arguments()
            .filter(|a| a.get_long().is_some_and(|l| l != "help"))
            .map(|a| {
                (
                    a.get_env()
                        .and_then(|e| e.to_str())
                        .unwrap_or("")
                        .to_owned(),
                    a.is_hide_env_values_set(),
                )
            })
            .collect();
        assert!(
            envs.contains(&("IDEM_METRICS_ADDR".to_owned(), true)),
            "{envs:?}"
        );
        assert!(
            envs.contains(&("IDEM_EFFECTS_AUTHORIZATION".to_owned(), true)),
            "a flag's own name is kept"
        );
        assert!(
            envs.iter()
                .all(|(e, hidden)| e.starts_with("IDEM_") && *hidden),
            "{envs:?}"
        );
    }

    #[test]
    fn the_command_line_outranks_the_environment_which_outranks_the_config_file() {
        let f = config("db = \"postgres://file/db\"\nmetrics-addr = \"127.0.0.1:1\"\n");
        let path = f.path().to_str().unwrap_or_else(|| panic!("path"));
        let m = run(&["idem", "relay", "--settings", path], &[]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            get(relay(&m), "db").map(String::as_str),
            Some("postgres://file/db")
        );
        let m = run(
            &[
                "idem",
                "relay",
                "--settings",
                path,
                "--db",
                "postgres://cli/db",
            ],
            &[],
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            get(relay(&m), "db").map(String::as_str),
            Some("postgres://cli/db")
        );
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let secret = dir.path().join("db-url");
        std::fs::write(&secret, "postgres://from-file/db\n").unwrap_or_else(|e| panic!("{e}"));
        let secret = secret.to_str().unwrap_or_else(|| panic!("path"));
        let m = run(
            &["idem", "relay", "--settings", path],
            &[("IDEM_DB_FILE", secret)],
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            get(relay(&m), "db").map(String::as_str),
            Some("postgres://from-file/db"),
            "the environment's file outranks the settings file; its newline dropped"
        );
        assert_eq!(
            get(relay(&m), "metrics-addr").map(String::as_str),
            Some("127.0.0.1:1")
        );
        let m = run(
            &["idem", "relay", "--db", "postgres://cli/db"],
            &[("IDEM_DB_FILE", secret)],
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            get(relay(&m), "db").map(String::as_str),
            Some("postgres://cli/db")
        );
    }

    #[test]
    fn a_subcommand_s_own_config_flag_is_its_own() {
        let cmd = command(
            Command::new("idem")
                .subcommand(Command::new("verify").arg(Arg::new("config").long("config"))),
        );
        let env = |_: &str| None;
        let argv = argv(
            &cmd,
            os(&["idem", "verify", "--config", "/verify.toml"]),
            &env,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let m = cmd
            .try_get_matches_from(argv)
            .unwrap_or_else(|e| panic!("{e}"));
        let verify = m
            .subcommand_matches("verify")
            .unwrap_or_else(|| panic!("verify"));
        assert_eq!(
            get(verify, "config").map(String::as_str),
            Some("/verify.toml")
        );
    }

    #[test]
    fn global_flags_before_the_subcommand_do_not_hide_it() {
        let f = config("db = \"postgres://file/db\"\n");
        let path = f.path().to_str().unwrap_or_else(|| panic!("path"));
        for args in [
            vec!["idem", "--settings", path, "relay"],
            vec!["idem", "--log-format", "json", "--settings", path, "relay"],
            vec!["idem", "--log-format=json", "relay", "--settings", path],
        ] {
            let m = run(&args, &[]).unwrap_or_else(|e| panic!("{args:?}: {e}"));
            assert_eq!(
                get(relay(&m), "db").map(String::as_str),
                Some("postgres://file/db"),
                "{args:?}"
            );
        }
    }

    #[test]
    fn lists_and_switches_come_from_the_config_file_too() {
        let f = config("db = \"d\"\ntopic = [\"order=a\", \"payment=b\"]\ncreate-topics = true\n");
        let path = f.path().to_str().unwrap_or_else(|| panic!("path"));
        let m = run(
            &["idem", "relay", "--settings", path, "--topic", "refund=c"],
            &[],
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let topics: Vec<&String> = relay(&m)
            .get_many::<String>("topic")
            .map(|v| v.collect())
            .unwrap_or_default();
        assert_eq!(topics, ["order=a", "payment=b", "refund=c"]);
        assert!(relay(&m).get_flag("create-topics"));
    }

    #[test]
    fn what_cannot_be_meant_is_refused_with_what_to_do() {
        let f = config("db = \"d\"\nbrokers = \"b\"\n");
        let path = f.path().to_str().unwrap_or_else(|| panic!("path"));
        let e = run(&["idem", "relay", "--settings", path], &[])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.contains("sets `brokers`, which is not a flag of `relay`"),
            "{e}"
        );
        let e = run(
            &["idem", "relay"],
            &[("IDEM_DB", "x"), ("IDEM_DB_FILE", "/x")],
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
        assert_eq!(e, "both IDEM_DB and IDEM_DB_FILE are set: keep one");
        let e = run(&["idem", "relay"], &[("IDEM_DB_FILE", "/nonexistent/db")])
            .err()
            .map(|e| format!("{e:#}"))
            .unwrap_or_default();
        assert!(
            e.starts_with("IDEM_DB_FILE=/nonexistent/db cannot be read"),
            "{e}"
        );
    }
}
