//! Test-only hooks: steps after which `MUSTER_FAULT_POINT` aborts the process, to prove
//! that a restart converges, `MUSTER_PAUSE_POINT` holds it until a file exists
//! (`MUSTER_PAUSE_UNTIL`), to change the cluster in the middle of a transition, and
//! writes that `MUSTER_FAIL_WRITE` makes fail once, as a refused request would, to
//! prove that the process itself recovers.

use muster_admission::State;

/// A kind of write the state machine asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Write {
    Record,
    Delete,
    Deallocate,
    Release,
}

impl Write {
    const ALL: [Write; 4] = [Write::Record, Write::Delete, Write::Deallocate, Write::Release];

    fn name(self) -> &'static str {
        match self {
            Write::Record => "record",
            Write::Delete => "delete",
            Write::Deallocate => "deallocate",
            Write::Release => "release",
        }
    }
}

const STATES: [State; 8] = [
    State::Reserving,
    State::Reserved,
    State::Released,
    State::TearingDown,
    State::Restarting,
    State::Suspending,
    State::Finishing,
    State::Finished,
];

fn state_name(state: State) -> &'static str {
    match state {
        State::Reserving => "reserving",
        State::Reserved => "reserved",
        State::Released => "released",
        State::TearingDown => "tearing-down",
        State::Restarting => "restarting",
        State::Suspending => "suspending",
        State::Finishing => "finishing",
        State::Finished => "finished",
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultPoint {
    AfterPlanRecorded,
    AfterFirstClaim,
    AfterAllClaims,
    AfterReserved,
    AfterFirstRelease,
    /// A preemptor's nomination is recorded; no victim is touched yet.
    AfterNominated,
    /// The first victim of a preemption is recorded as being torn down.
    AfterFirstVictim,
    /// After the first write of this kind that the state machine makes in this state.
    After(State, Write),
}

impl FaultPoint {
    /// Every fault point: the commit's steps, then each state's writes.
    pub fn all() -> Vec<FaultPoint> {
        let mut all = vec![
            FaultPoint::AfterPlanRecorded,
            FaultPoint::AfterFirstClaim,
            FaultPoint::AfterAllClaims,
            FaultPoint::AfterReserved,
            FaultPoint::AfterFirstRelease,
            FaultPoint::AfterNominated,
            FaultPoint::AfterFirstVictim,
        ];
        for state in STATES {
            for write in Write::ALL {
                all.push(FaultPoint::After(state, write));
            }
        }
        all
    }

    pub fn name(self) -> String {
        match self {
            FaultPoint::AfterPlanRecorded => "after-plan-recorded".into(),
            FaultPoint::AfterFirstClaim => "after-first-claim".into(),
            FaultPoint::AfterAllClaims => "after-all-claims".into(),
            FaultPoint::AfterReserved => "after-reserved".into(),
            FaultPoint::AfterFirstRelease => "after-first-release".into(),
            FaultPoint::AfterNominated => "after-nominated".into(),
            FaultPoint::AfterFirstVictim => "after-first-victim".into(),
            FaultPoint::After(state, write) => format!("after-{}-{}", state_name(state), write.name()),
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        Self::all().into_iter().find(|f| f.name() == text)
    }
}

/// Test-only: a write that fails once, as if the API server had refused it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailWrite {
    /// The first record of a commit (its plan, state `Reserving`).
    PlanRecord,
}

impl FailWrite {
    pub fn name(self) -> &'static str {
        match self {
            FailWrite::PlanRecord => "plan-record",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        [FailWrite::PlanRecord].into_iter().find(|f| f.name() == text)
    }
}

/// Test-only: hold at `point` until the file `until` exists.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pause {
    pub point: FaultPoint,
    pub until: std::path::PathBuf,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_fault_point_parses_back_from_its_name() {
        let all = FaultPoint::all();
        assert_eq!(all.len(), 7 + 8 * 4);
        for point in all {
            assert_eq!(FaultPoint::parse(&point.name()), Some(point));
        }
        assert_eq!(
            FaultPoint::parse("after-tearing-down-deallocate"),
            Some(FaultPoint::After(State::TearingDown, Write::Deallocate))
        );
    }
}
