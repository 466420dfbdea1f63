//! What one listener lets its callers hold. Every connection is accepted (a listener that
//! stops accepting lets idle connections starve the next caller, the kubelet's probe or
//! the API server's webhook call); past the budget, the oldest idle connection of the
//! peer holding the most is closed to make room, and only when every connection is in
//! the middle of a request is the newcomer turned away. A connection idle longer than
//! its listener allows is closed, and none lives longer than its lifetime, so what one
//! peer holds is bounded by time as well as by count.

use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use tokio::sync::Notify;

/// A listener's limits.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections open at once.
    pub connections: usize,
    /// Connections one peer may hold: past it, its own oldest idle one makes room, or
    /// (all busy) the newcomer is turned away, whatever room others left.
    pub per_peer: usize,
    /// How long a connection may wait between requests (or for its first one).
    pub idle: Duration,
    /// Longest life of a connection; a client simply opens the next one.
    pub lifetime: Duration,
}

/// How a connection ended, as far as the budget is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    /// The connection ended by itself (the caller closed it, or an error).
    Closed,
    /// Idle past its listener's limit.
    Idle,
    /// Closed to make room for a newcomer.
    Shed,
    /// At the end of its lifetime.
    Lifetime,
}

/// The connections of one listener.
pub struct Budget {
    limits: Limits,
    epoch: Instant,
    open: Mutex<Open>,
}

#[derive(Default)]
struct Open {
    next: u64,
    connections: HashMap<u64, Entry>,
}

struct Entry {
    peer: IpAddr,
    state: Arc<State>,
}

/// What a connection is doing, shared between its task and the budget.
struct State {
    /// Requests in flight.
    busy: AtomicUsize,
    /// When it was last active, in milliseconds since the budget's epoch.
    active_at: AtomicU64,
    /// Told when the connection is to close to make room.
    shed: Notify,
}

impl Budget {
    pub fn new(limits: Limits) -> Arc<Self> {
        Arc::new(Budget {
            limits,
            epoch: Instant::now(),
            open: Mutex::new(Open::default()),
        })
    }

    fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Room for a connection from `peer`, shedding an idle one if the budget is spent;
    /// `None` when every open connection is busy with a request.
    pub fn admit(self: &Arc<Self>, peer: IpAddr) -> Option<Ticket> {
        let mut open = self.open.lock().expect("connection budget");
        let held = open.connections.values().filter(|e| e.peer == peer).count();
        let victim = if held >= self.limits.per_peer.max(1) {
            Some(shed_choice(&open.connections, Some(peer))?)
        } else if open.connections.len() >= self.limits.connections.max(1) {
            Some(shed_choice(&open.connections, None)?)
        } else {
            None
        };
        if let Some(entry) = victim.and_then(|v| open.connections.remove(&v)) {
            entry.state.shed.notify_one();
        }
        let id = open.next;
        open.next += 1;
        let state = Arc::new(State {
            busy: AtomicUsize::new(0),
            active_at: AtomicU64::new(self.now()),
            shed: Notify::new(),
        });
        open.connections.insert(
            id,
            Entry {
                peer,
                state: state.clone(),
            },
        );
        Some(Ticket {
            id,
            budget: self.clone(),
            state,
        })
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.open.lock().expect("connection budget").connections.len()
    }
}

/// The connection to close to make room: an idle one of the peer that holds the most
/// connections (or of `only` that peer), the longest idle of them. A peer that opens many
/// connections loses its own first; one with a few (the kubelet) keeps them.
fn shed_choice(connections: &HashMap<u64, Entry>, only: Option<IpAddr>) -> Option<u64> {
    let mut held: HashMap<IpAddr, usize> = HashMap::new();
    for entry in connections.values() {
        *held.entry(entry.peer).or_default() += 1;
    }
    connections
        .iter()
        .filter(|(_, e)| only.is_none_or(|peer| e.peer == peer))
        .filter(|(_, e)| e.state.busy.load(Ordering::Acquire) == 0)
        .max_by_key(|(id, e)| {
            let idle_since = e.state.active_at.load(Ordering::Acquire);
            (held[&e.peer], std::cmp::Reverse(idle_since), std::cmp::Reverse(**id))
        })
        .map(|(id, _)| *id)
}

/// One admitted connection's place in the budget; dropping it gives the place back.
pub struct Ticket {
    id: u64,
    budget: Arc<Budget>,
    state: Arc<State>,
}

impl Ticket {
    /// A handle for the connection's service to mark its requests with: a request in
    /// flight is neither idle nor shed.
    pub fn marker(&self) -> Marker {
        Marker {
            state: self.state.clone(),
            budget: self.budget.clone(),
        }
    }

    /// Runs `connection` until it ends, it is idle too long, it is shed or its
    /// lifetime is over (then it is dropped, which closes it).
    pub async fn drive<F: Future>(&self, connection: F) -> End {
        let lifetime = tokio::time::sleep(self.budget.limits.lifetime);
        tokio::select! {
            _ = connection => End::Closed,
            () = self.state.shed.notified() => End::Shed,
            () = self.idle_expiry() => End::Idle,
            () = lifetime => End::Lifetime,
        }
    }

    async fn idle_expiry(&self) {
        let idle = self.budget.limits.idle;
        let limit = u64::try_from(idle.as_millis()).unwrap_or(u64::MAX);
        loop {
            let now = self.budget.now();
            let since = now.saturating_sub(self.state.active_at.load(Ordering::Acquire));
            if self.state.busy.load(Ordering::Acquire) == 0 && since >= limit {
                return;
            }
            // Busy: look again within the limit; idle: when the limit is reached.
            let wait = if self.state.busy.load(Ordering::Acquire) > 0 {
                idle
            } else {
                Duration::from_millis(limit - since)
            };
            tokio::time::sleep(wait.max(Duration::from_millis(10))).await;
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.budget
            .open
            .lock()
            .expect("connection budget")
            .connections
            .remove(&self.id);
    }
}

/// Marks requests of one connection from inside its service.
#[derive(Clone)]
pub struct Marker {
    state: Arc<State>,
    budget: Arc<Budget>,
}

impl Marker {
    pub fn busy(&self) -> Busy {
        self.state.busy.fetch_add(1, Ordering::AcqRel);
        Busy {
            state: self.state.clone(),
            budget: self.budget.clone(),
        }
    }
}

/// A request in flight.
pub struct Busy {
    state: Arc<State>,
    budget: Arc<Budget>,
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.state.active_at.store(self.budget.now(), Ordering::Release);
        self.state.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(connections: usize) -> Limits {
        Limits {
            connections,
            per_peer: connections,
            idle: Duration::from_secs(10),
            lifetime: Duration::from_secs(60),
        }
    }

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    #[tokio::test(start_paused = true)]
    async fn a_peer_holding_many_idle_connections_loses_its_oldest_to_a_newcomer() {
        let budget = Budget::new(limits(3));
        let first = budget.admit(ip(2)).unwrap();
        tokio::time::advance(Duration::from_millis(5)).await;
        let _second = budget.admit(ip(2)).unwrap();
        let _kubelet = budget.admit(ip(1)).unwrap();
        let _probe = budget.admit(ip(1)).expect("room is made");
        assert_eq!(budget.open(), 3);
        assert_eq!(first.drive(std::future::pending::<()>()).await, End::Shed);
    }

    #[tokio::test(start_paused = true)]
    async fn busy_connections_are_never_shed_and_a_newcomer_then_waits_outside() {
        let budget = Budget::new(limits(2));
        let a = budget.admit(ip(2)).unwrap();
        let b = budget.admit(ip(2)).unwrap();
        let (_a, _b) = (a.marker().busy(), b.marker().busy());
        assert!(budget.admit(ip(1)).is_none(), "all busy: refused");
        drop(_a);
        assert!(budget.admit(ip(1)).is_some(), "an idle one makes room");
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_closes_after_its_limit_but_not_while_busy() {
        let budget = Budget::new(limits(4));
        let idle = budget.admit(ip(2)).unwrap();
        let started = tokio::time::Instant::now();
        assert_eq!(idle.drive(std::future::pending::<()>()).await, End::Idle);
        assert!(started.elapsed() >= Duration::from_secs(10));

        let working = budget.admit(ip(2)).unwrap();
        let request = working.marker().busy();
        let ends = working.drive(async {
            tokio::time::sleep(Duration::from_secs(30)).await;
            drop(request);
            std::future::pending::<()>().await
        });
        let started = tokio::time::Instant::now();
        assert_eq!(ends.await, End::Idle);
        assert!(
            started.elapsed() >= Duration::from_secs(40),
            "idle counts from the end of its request"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_ends_at_its_lifetime() {
        let budget = Budget::new(Limits {
            idle: Duration::from_secs(600),
            ..limits(4)
        });
        let ticket = budget.admit(ip(2)).unwrap();
        let _busy = ticket.marker().busy();
        assert_eq!(ticket.drive(std::future::pending::<()>()).await, End::Lifetime);
    }

    #[tokio::test(start_paused = true)]
    async fn a_closed_connection_gives_its_place_back() {
        let budget = Budget::new(limits(1));
        let ticket = budget.admit(ip(2)).unwrap();
        assert_eq!(ticket.drive(async {}).await, End::Closed);
        drop(ticket);
        assert_eq!(budget.open(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn one_peer_holds_at_most_its_share_whatever_room_is_left() {
        let budget = Budget::new(Limits {
            per_peer: 2,
            ..limits(8)
        });
        let first = budget.admit(ip(2)).unwrap();
        let second = budget.admit(ip(2)).unwrap();
        let _busy = second.marker().busy();
        let _third = budget.admit(ip(2)).expect("its own idle one makes room");
        assert_eq!(first.drive(std::future::pending::<()>()).await, End::Shed);
        drop(first);
        let _also_busy = _third.marker().busy();
        assert!(budget.admit(ip(2)).is_none(), "both of its own busy: turned away");
        assert!(budget.admit(ip(1)).is_some(), "others still get in");
    }
}
