//! Test-only hooks: steps after which `MUSTER_FAULT_POINT` aborts the process, to prove
//! that a restart converges, `MUSTER_PAUSE_POINT` holds it until a file exists
//! (`MUSTER_PAUSE_UNTIL`), to change the cluster in the middle of a transition, and
//! writes that `MUSTER_FAIL_WRITE` makes fail once, as a refused request would, to
//! prove that the process itself recovers.
//!
//! Only a build with the `faults` feature (the end-to-end tests') reads them; a shipped
//! build refuses to start when they are set, rather than ignore what was asked.

use muster_admission::State;

/// A kind of write the state machine asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Write {
    Record,
    Delete,
    Deallocate,
    Release,
    /// The owners of the gang's pods suspended, marked as muster's.
    Suspend,
    /// The owners muster suspended resumed.
    Resume,
}

impl Write {
    const ALL: [Write; 6] = [
        Write::Record,
        Write::Delete,
        Write::Deallocate,
        Write::Release,
        Write::Suspend,
        Write::Resume,
    ];

    fn name(self) -> &'static str {
        match self {
            Write::Record => "record",
            Write::Delete => "delete",
            Write::Deallocate => "deallocate",
            Write::Release => "release",
            Write::Suspend => "suspend",
            Write::Resume => "resume",
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
    /// The reservation of a commit's claims, its plan recorded: the commit is undone
    /// through the state machine.
    ClaimReservation,
}

impl FailWrite {
    pub fn name(self) -> &'static str {
        match self {
            FailWrite::PlanRecord => "plan-record",
            FailWrite::ClaimReservation => "claim-reservation",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        [FailWrite::PlanRecord, FailWrite::ClaimReservation]
            .into_iter()
            .find(|f| f.name() == text)
    }
}

/// Test-only: hold at `point` until the file `until` exists.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pause {
    pub point: FaultPoint,
    pub until: std::path::PathBuf,
}

/// The test hooks asked for through the environment.
#[derive(Clone, Debug, Default)]
pub struct Injected {
    pub fault: Option<FaultPoint>,
    pub pause: Option<Pause>,
    pub fail: Option<FailWrite>,
}

/// Whether this build has fault points at all.
pub const COMPILED_IN: bool = cfg!(feature = "faults");

const VARIABLES: [&str; 4] = [
    "MUSTER_FAULT_POINT",
    "MUSTER_PAUSE_POINT",
    "MUSTER_PAUSE_UNTIL",
    "MUSTER_FAIL_WRITE",
];

/// A hook named in the environment that does not exist, or one set for a build without
/// fault points.
#[derive(Debug, thiserror::Error)]
pub enum InjectedError {
    #[error("unknown {variable} {value:?}")]
    Unknown { variable: &'static str, value: String },
    #[error("MUSTER_PAUSE_POINT needs MUSTER_PAUSE_UNTIL, the file whose creation ends the pause")]
    PauseWithoutEnd,
    #[error("{0} is set, but this build has no fault points (build with --features faults)")]
    NotCompiledIn(&'static str),
}

impl Injected {
    pub fn from_env() -> Result<Self, InjectedError> {
        let var = |name: &'static str| std::env::var(name).ok();
        if !COMPILED_IN {
            return match VARIABLES.into_iter().find(|v| var(v).is_some()) {
                Some(variable) => Err(InjectedError::NotCompiledIn(variable)),
                None => Ok(Injected::default()),
            };
        }
        let point = |variable: &'static str| {
            var(variable)
                .map(|value| FaultPoint::parse(&value).ok_or(InjectedError::Unknown { variable, value }))
                .transpose()
        };
        let pause = match point("MUSTER_PAUSE_POINT")? {
            Some(point) => Some(Pause {
                point,
                until: var("MUSTER_PAUSE_UNTIL").ok_or(InjectedError::PauseWithoutEnd)?.into(),
            }),
            None => None,
        };
        let fail = var("MUSTER_FAIL_WRITE")
            .map(|value| {
                FailWrite::parse(&value).ok_or(InjectedError::Unknown {
                    variable: "MUSTER_FAIL_WRITE",
                    value,
                })
            })
            .transpose()?;
        Ok(Injected {
            fault: point("MUSTER_FAULT_POINT")?,
            pause,
            fail,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_fault_point_parses_back_from_its_name() {
        let all = FaultPoint::all();
        assert_eq!(all.len(), 7 + 8 * 6);
        for point in all {
            assert_eq!(FaultPoint::parse(&point.name()), Some(point));
        }
        assert_eq!(
            FaultPoint::parse("after-tearing-down-deallocate"),
            Some(FaultPoint::After(State::TearingDown, Write::Deallocate))
        );
        assert_eq!(
            FaultPoint::parse("after-tearing-down-suspend"),
            Some(FaultPoint::After(State::TearingDown, Write::Suspend))
        );
    }
}
