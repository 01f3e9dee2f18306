//! Sign-ins. The dashboard's sign-in opens a session: a random token in
//! the browser's cookie, and its digest kept in this process only, so a
//! cookie tells nothing of the key, stops working when its session expires
//! (12 hours without a request, 7 days after the sign-in, whichever comes
//! first) and dies with the server (restarting it signs everyone out).
//!
//! A client (an IP address) that offers wrong keys, by the sign-in or in a
//! request's header, gets a few tries free and then waits, twice as long
//! after each further wrong one; a key offered while it waits is not
//! looked at (429, with `Retry-After`), so waiting is the only way on.

use std::collections::HashMap;
use std::io::Read;
use std::net::IpAddr;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::keys::digest;

/// How long a session lasts without a request.
pub const IDLE: Duration = Duration::from_secs(12 * 3600);
/// How long a session lasts at most after its sign-in.
pub const LIFETIME: Duration = Duration::from_secs(7 * 24 * 3600);
/// Sessions kept at most; a sign-in beyond ends the least recently used.
const MOST_SESSIONS: usize = 1024;

/// Wrong keys a client may offer before it must wait.
pub const FREE_TRIES: u32 = 5;
/// The wait after the first wrong key beyond the free ones; it doubles
/// with each further one.
const FIRST_WAIT: Duration = Duration::from_secs(1);
/// The longest wait.
const LONGEST_WAIT: Duration = Duration::from_secs(15 * 60);
/// How long a client's wrong keys are remembered after its last one
/// (and after its wait).
const FORGET_AFTER: Duration = Duration::from_secs(15 * 60);
/// Clients remembered at most; beyond, the one whose last wrong key is
/// oldest is forgotten.
const MOST_CLIENTS: usize = 4096;

/// The open sessions, by the digest of their token.
#[derive(Default)]
pub struct Sessions {
    open: Mutex<HashMap<[u8; 32], Session>>,
}

#[derive(Clone, Copy)]
struct Session {
    opened: Instant,
    used: Instant,
}

impl Session {
    fn alive(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.used) < IDLE
            && now.saturating_duration_since(self.opened) < LIFETIME
    }
}

impl Sessions {
    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 32], Session>> {
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Opens a session at `now`: its token, for the cookie.
    pub fn open(&self, now: Instant) -> std::io::Result<String> {
        let mut bytes = [0u8; 32];
        std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
        let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let mut table = self.table();
        table.retain(|_, session| session.alive(now));
        if table.len() >= MOST_SESSIONS
            && let Some(oldest) = table
                .iter()
                .min_by_key(|(_, session)| session.used)
                .map(|(id, _)| *id)
        {
            table.remove(&oldest);
        }
        table.insert(
            digest(&token),
            Session {
                opened: now,
                used: now,
            },
        );
        Ok(token)
    }

    /// Whether `token` is an open session's at `now` (which then counts as
    /// its last use).
    pub fn check(&self, token: &str, now: Instant) -> bool {
        let id = digest(token);
        let mut table = self.table();
        match table.get_mut(&id) {
            Some(session) if session.alive(now) => {
                session.used = now;
                true
            }
            Some(_) => {
                table.remove(&id);
                false
            }
            None => false,
        }
    }
}

/// Each client's wrong keys.
#[derive(Default)]
pub struct Attempts {
    clients: Mutex<HashMap<IpAddr, Failures>>,
}

#[derive(Clone, Copy)]
struct Failures {
    count: u32,
    last: Instant,
    /// No key of the client's is looked at before then.
    until: Option<Instant>,
}

impl Failures {
    fn forgotten(&self, now: Instant) -> bool {
        let since = self.until.map_or(self.last, |until| until.max(self.last));
        now.saturating_duration_since(since) >= FORGET_AFTER
    }
}

impl Attempts {
    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, Failures>> {
        self.clients.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// How long `client` must still wait before a key of its is looked at;
    /// `None`: it need not.
    pub fn wait(&self, client: IpAddr, now: Instant) -> Option<Duration> {
        let table = self.table();
        let until = table.get(&client)?.until?;
        (until > now).then(|| until - now)
    }

    /// `client` offered a wrong key at `now`.
    pub fn failed(&self, client: IpAddr, now: Instant) {
        let mut table = self.table();
        if table.len() >= MOST_CLIENTS && !table.contains_key(&client) {
            table.retain(|_, failures| !failures.forgotten(now));
            if table.len() >= MOST_CLIENTS
                && let Some(stalest) = table
                    .iter()
                    .min_by_key(|(_, failures)| failures.last)
                    .map(|(ip, _)| *ip)
            {
                table.remove(&stalest);
            }
        }
        let failures = table.entry(client).or_insert(Failures {
            count: 0,
            last: now,
            until: None,
        });
        if failures.forgotten(now) {
            failures.count = 0;
        }
        failures.count = failures.count.saturating_add(1);
        failures.last = now;
        if failures.count > FREE_TRIES {
            let doublings = (failures.count - FREE_TRIES - 1).min(20);
            let wait = FIRST_WAIT.saturating_mul(1 << doublings).min(LONGEST_WAIT);
            failures.until = Some(now + wait);
        }
    }

    /// `client` offered the right key: its wrong ones are forgotten.
    pub fn succeeded(&self, client: IpAddr) {
        self.table().remove(&client);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_ends_when_idle_too_long_or_too_old_and_only_its_token_opens_it() {
        let sessions = Sessions::default();
        let start = Instant::now();
        let token = sessions.open(start).unwrap();
        let other = sessions.open(start).unwrap();
        assert_ne!(token, other, "tokens are random");
        assert_eq!(token.len(), 64);
        assert!(sessions.check(&token, start));
        assert!(!sessions.check("0".repeat(64).as_str(), start));
        // Used every 6 hours, it lives on, up to its lifetime.
        let mut now = start;
        while now + Duration::from_secs(6 * 3600) < start + LIFETIME {
            now += Duration::from_secs(6 * 3600);
            assert!(sessions.check(&token, now));
        }
        assert!(!sessions.check(&token, start + LIFETIME));
        // Unused for 12 hours, it is gone, and stays gone.
        assert!(!sessions.check(&other, start + IDLE));
        assert!(!sessions.check(&other, start));
        // Another table (another process) knows none of them.
        let fresh = sessions.open(start).unwrap();
        assert!(!Sessions::default().check(&fresh, start));
    }

    #[test]
    fn a_client_waits_twice_as_long_after_each_wrong_key_beyond_the_free_ones() {
        let attempts = Attempts::default();
        let client: IpAddr = "10.0.0.7".parse().unwrap();
        let neighbour: IpAddr = "10.0.0.8".parse().unwrap();
        let start = Instant::now();
        for _ in 0..FREE_TRIES {
            assert_eq!(attempts.wait(client, start), None);
            attempts.failed(client, start);
        }
        assert_eq!(attempts.wait(client, start), None);
        attempts.failed(client, start);
        assert_eq!(attempts.wait(client, start), Some(Duration::from_secs(1)));
        assert_eq!(attempts.wait(neighbour, start), None, "per client");
        let mut now = start + Duration::from_secs(1);
        assert_eq!(attempts.wait(client, now), None);
        attempts.failed(client, now);
        assert_eq!(attempts.wait(client, now), Some(Duration::from_secs(2)));
        now += Duration::from_secs(2);
        attempts.failed(client, now);
        assert_eq!(attempts.wait(client, now), Some(Duration::from_secs(4)));
        for _ in 0..30 {
            now += attempts.wait(client, now).unwrap_or_default();
            attempts.failed(client, now);
        }
        assert_eq!(attempts.wait(client, now), Some(LONGEST_WAIT));
        // Long after, the client starts again with its free tries.
        now += LONGEST_WAIT + FORGET_AFTER;
        assert_eq!(attempts.wait(client, now), None);
        attempts.failed(client, now);
        assert_eq!(attempts.wait(client, now), None);
        // The right key forgets the wrong ones.
        for _ in 0..FREE_TRIES {
            attempts.failed(neighbour, start);
        }
        attempts.succeeded(neighbour);
        attempts.failed(neighbour, start);
        assert_eq!(attempts.wait(neighbour, start), None);
    }
}
