//! Machine-wide leases on chosen ports, shared by every process that chooses ports of the
//! range (the Rust harnesses here and `scripts/kafka prepare`).
//!
//! A lease is the file `$TMPDIR/idem-ports/PORT` (`/tmp/idem-ports/PORT` without `TMPDIR`)
//! holding its owner, `PID STARTTIME` (the process id and its start time, field 22 of
//! `/proc/PID/stat`, so that a reused process id does not keep a dead owner's leases). A lease
//! is live while its owner runs, and refused to every chooser, its owner too (one process
//! runs many servers); a dead owner's lease is free to take. Readers and writers hold
//! `flock(2)` on the file, so two choosers never both take one port.
//!
//! The owner is the process that binds the port or starts what binds it and lives as long as
//! it does (a test process and its servers): a server that stops for a while (a crash, a
//! restart) keeps its port though nothing listens on it then.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::PathBuf;

/// A process, named so that a later process given the same id is another one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Owner {
    pid: u32,
    start: u64,
}

impl Owner {
    /// This process.
    pub fn this_process() -> io::Result<Owner> {
        Owner::of(std::process::id())?.ok_or_else(|| io::Error::other("/proc/self is not there"))
    }

    /// The process `pid`, if it runs (one that ends while its `stat` is read, ESRCH, does not).
    pub fn of(pid: u32) -> io::Result<Option<Owner>> {
        const ESRCH: i32 = 3;
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Ok(stat) => Ok(start_time(&stat).map(|start| Owner { pid, start })),
            Err(e) if e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(ESRCH) => {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether it started no earlier than `other` (in the kernel's clock ticks).
    pub fn started_since(&self, other: &Owner) -> bool {
        self.start >= other.start
    }

    fn parse(text: &str) -> Option<Owner> {
        let mut fields = text.split_whitespace().map(str::parse::<u64>);
        let pid = u32::try_from(fields.next()?.ok()?).ok()?;
        let start = fields.next()?.ok()?;
        Some(Owner { pid, start })
    }

    fn is_alive(&self) -> io::Result<bool> {
        Ok(Owner::of(self.pid)? == Some(*self))
    }
}

/// Field 22 of a `/proc/PID/stat` line, the process's start time; counted after the command
/// name's closing parenthesis, since the name itself may hold spaces and parentheses.
fn start_time(stat: &str) -> Option<u64> {
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// The folder of one machine's leases.
#[derive(Debug)]
pub struct Leases {
    dir: PathBuf,
}

impl Leases {
    /// The machine's leases, `$TMPDIR/idem-ports`, made if missing (open to every user, as
    /// `/tmp` is: a lease names its owner, whoever wrote it); refused when it is a link.
    pub fn machine() -> io::Result<Leases> {
        Leases::at(std::env::temp_dir().join("idem-ports"))
    }

    pub(crate) fn at(dir: PathBuf) -> io::Result<Leases> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        match std::fs::symlink_metadata(&dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(io::Error::other(format!(
                    "{} is not a directory (a link, or a file): remove it",
                    dir.display()
                )));
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o1777)
                    .create(&dir)?;
                std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777))?;
            }
            Err(e) => return Err(e),
        }
        Ok(Leases { dir })
    }

    /// Takes the lease on `port` for `me`: true unless a live process, `me` included, holds
    /// it. A process that holds a lease took that port for one of its servers already, so
    /// the lease refuses it a second time, as it refuses every other process.
    pub fn take(&self, port: u16, me: &Owner) -> io::Result<bool> {
        // A lease file another user made, or a link in its place, is not this process's to
        // take: the port is taken.
        let mut file = match self.open(port) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => return Ok(false),
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Ok(false),
            Err(e) => return Err(e),
        };
        file.lock()?;
        if let Some(holder) = read_owner(&mut file)?
            && holder.is_alive()?
        {
            return Ok(false);
        }
        file.set_len(0)?;
        file.seek(SeekFrom::Start(0))?;
        writeln!(file, "{} {}", me.pid, me.start)?;
        Ok(true)
    }

    /// The live process holding the lease on `port`, if one does.
    pub fn holder(&self, port: u16) -> io::Result<Option<Owner>> {
        let mut file = self.open(port)?;
        file.lock_shared()?;
        match read_owner(&mut file)? {
            Some(holder) if holder.is_alive()? => Ok(Some(holder)),
            _ => Ok(None),
        }
    }

    /// The lease file of `port`, made if missing; never through a symbolic link.
    fn open(&self, port: u16) -> io::Result<File> {
        use std::os::unix::fs::OpenOptionsExt;
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o666)
            .custom_flags(libc::O_NOFOLLOW)
            .open(self.dir.join(port.to_string()))
    }
}

fn read_owner(file: &mut File) -> io::Result<Option<Owner>> {
    let mut text = String::new();
    file.read_to_string(&mut text)?;
    Ok(Owner::parse(&text))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};

    fn leases() -> (tempfile::TempDir, Leases) {
        let dir = tempfile::tempdir().unwrap();
        let leases = Leases::at(dir.path().join("idem-ports")).unwrap();
        (dir, leases)
    }

    #[test]
    fn the_start_time_is_read_past_a_command_name_with_spaces_and_parentheses() {
        let stat = "42 (a (b) c) S 1 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 98765 1 2";
        assert_eq!(start_time(stat), Some(98_765));
        assert_eq!(start_time("42 (x) S 1"), None);
    }

    #[test]
    fn a_live_process_keeps_its_lease_until_it_ends() {
        let (_dir, leases) = leases();
        let mut child = Command::new("sleep")
            .arg("600")
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let other = Owner::of(child.id()).unwrap().unwrap();
        let me = Owner::this_process().unwrap();
        assert!(leases.take(20_000, &other).unwrap());
        assert!(!leases.take(20_000, &me).unwrap(), "a live holder's lease");
        assert_eq!(leases.holder(20_000).unwrap(), Some(other));
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(leases.holder(20_000).unwrap(), None);
        assert!(leases.take(20_000, &me).unwrap(), "a dead holder's lease");
        assert_eq!(leases.holder(20_000).unwrap(), Some(me));
        assert!(!leases.take(20_000, &me).unwrap(), "its own lease again");
    }

    #[test]
    fn a_link_in_place_of_a_lease_is_never_written_through() {
        let (dir, leases) = leases();
        let target = dir.path().join("target");
        std::fs::write(&target, "keep me").unwrap();
        std::os::unix::fs::symlink(&target, dir.path().join("idem-ports/20002")).unwrap();
        let me = Owner::this_process().unwrap();
        assert!(!leases.take(20_002, &me).unwrap(), "a link is a taken port");
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep me");
        let linked = dir.path().join("linked");
        std::os::unix::fs::symlink(dir.path().join("idem-ports"), &linked).unwrap();
        assert!(Leases::at(linked).is_err(), "a linked folder is refused");
    }

    #[test]
    fn a_reused_process_id_does_not_hold_the_dead_owners_leases() {
        let (_dir, leases) = leases();
        let me = Owner::this_process().unwrap();
        let earlier = Owner {
            pid: me.pid,
            start: me.start.wrapping_sub(1),
        };
        assert!(leases.take(20_001, &earlier).unwrap());
        assert_eq!(leases.holder(20_001).unwrap(), None);
        assert!(leases.take(20_001, &me).unwrap());
    }
}
