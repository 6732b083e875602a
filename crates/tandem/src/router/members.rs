//! The workers a router knows: who registered, in which role, how loaded they said they are,
//! and how many of the router's requests are in flight on each. A worker renews its
//! registration every second; one silent for `SILENCE`, or that failed a request since its
//! last renewal, gets no requests.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a worker may go without renewing its registration and still get requests.
pub const SILENCE: Duration = Duration::from_secs(3);

#[derive(Clone, Debug)]
pub struct Member {
    pub role: String,
    pub url: String,
    pub last_seen: Instant,
    /// Its load at its last renewal: sequences running, requests waiting, the most it runs.
    pub active: usize,
    pub queued: usize,
    pub max_concurrent: usize,
    /// The router's requests in flight on it now.
    pub in_flight: usize,
    /// When a request to it failed (a connection refused or broken), until it renews.
    pub failed: Option<Instant>,
}

impl Member {
    fn live(&self, now: Instant) -> bool {
        now.duration_since(self.last_seen) < SILENCE && self.failed.is_none_or(|f| f < self.last_seen)
    }
}

#[derive(Default)]
pub struct Members {
    workers: Mutex<HashMap<String, Member>>,
}

/// A request in flight on a worker: counted until dropped.
pub struct InFlight {
    members: Arc<Members>,
    url: String,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(m) = self.members.workers.lock().expect("members lock").get_mut(&self.url) {
            m.in_flight = m.in_flight.saturating_sub(1);
        }
    }
}

impl Members {
    /// A worker's registration or renewal; returns whether it is new (or back after silence
    /// or a failure).
    pub fn register(&self, role: &str, url: &str, active: usize, queued: usize, max_concurrent: usize) -> bool {
        let now = Instant::now();
        let mut workers = self.workers.lock().expect("members lock");
        let back = workers.get(url).is_none_or(|m| !m.live(now) || m.role != role);
        let in_flight = workers.get(url).map_or(0, |m| m.in_flight);
        let failed = workers.get(url).and_then(|m| m.failed);
        workers.insert(url.to_string(), Member { role: role.to_string(), url: url.to_string(), last_seen: now, active, queued, max_concurrent, in_flight, failed });
        back
    }

    /// The workers of `role` that may get requests.
    pub fn live(&self, role: &str) -> Vec<Member> {
        let now = Instant::now();
        let mut v: Vec<Member> = self.workers.lock().expect("members lock").values().filter(|m| m.role == role && m.live(now)).cloned().collect();
        v.sort_by(|a, b| a.url.cmp(&b.url));
        v
    }

    /// Every worker known, live or not, with whether it is live.
    pub fn all(&self) -> Vec<(Member, bool)> {
        let now = Instant::now();
        let mut v: Vec<(Member, bool)> = self.workers.lock().expect("members lock").values().map(|m| (m.clone(), m.live(now))).collect();
        v.sort_by(|a, b| a.0.url.cmp(&b.0.url));
        v
    }

    /// A request to `url` failed: no more requests go there until it renews its registration.
    pub fn failed(&self, url: &str) {
        if let Some(m) = self.workers.lock().expect("members lock").get_mut(url) {
            m.failed = Some(Instant::now());
        }
    }

    /// Count a request in flight on `url` until the guard is dropped.
    pub fn begin(self: &Arc<Self>, url: &str) -> InFlight {
        if let Some(m) = self.workers.lock().expect("members lock").get_mut(url) {
            m.in_flight += 1;
        }
        InFlight { members: Arc::clone(self), url: url.to_string() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_that_failed_gets_nothing_until_it_renews() {
        let m = Arc::new(Members::default());
        assert!(m.register("decode", "http://a:1", 0, 0, 8));
        assert!(!m.register("decode", "http://a:1", 1, 0, 8), "a renewal is not new");
        assert!(m.register("prefill", "http://b:1", 0, 0, 8));
        assert_eq!(m.live("decode").len(), 1);
        assert_eq!(m.live("prefill").len(), 1);
        {
            let _a = m.begin("http://a:1");
            let _b = m.begin("http://a:1");
            assert_eq!(m.live("decode")[0].in_flight, 2);
        }
        assert_eq!(m.live("decode")[0].in_flight, 0, "in-flight requests are counted until their guard goes");
        m.failed("http://a:1");
        assert!(m.live("decode").is_empty(), "a failed worker gets no requests");
        std::thread::sleep(Duration::from_millis(2));
        assert!(m.register("decode", "http://a:1", 0, 0, 8), "back once it renews");
        assert_eq!(m.live("decode").len(), 1);
    }
}
