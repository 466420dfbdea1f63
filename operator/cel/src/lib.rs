//! CEL device selectors, compiled as the API server compiles them and evaluated as
//! kube-scheduler evaluates them (Kubernetes 1.37).
//!
//! # The environment (this crate's contract)
//!
//! `k8s.io/dynamic-resource-allocation/cel` builds its environment on
//! `environment.MustBaseEnvSet(DefaultCompatibilityVersion())`: in 1.37 the
//! compatibility version is 1.36. The API server compiles a new selector in that set's
//! "NewExpressions" environment (libraries introduced by 1.36 and not removed by then),
//! refuses it if it does not type-check, if a validator or the program's constant
//! folding fails, if its type is not `bool` (or the attribute type), or if its
//! estimated cost exceeds 1,000,000; kube-scheduler evaluates stored selectors with a
//! runtime limit of 1,000,000. `device` is a `kubernetes.DRADevice` with `driver`,
//! `attributes` (attribute values declared `google.protobuf.Any`), `capacity` and, with
//! DRAConsumableCapacity (on by default since 1.36), `allowMultipleAllocations`.
//!
//! Library (version) — status here; "before" is the untyped interpreter this replaced:
//! - standard library: operators, conversions, `size`, `type`, `dyn`, `contains`,
//!   `startsWith`, `endsWith`, `matches`, macros `has`, `all`, `exists`, `exists_one`,
//!   `map`, `filter` — implemented before, now type-checked;
//!   `timestamp`/`duration` (module `time`): conversions from strings (Go's RFC 3339
//!   `time.Parse`, `time.ParseDuration`) and ints, to strings and ints, arithmetic and
//!   comparisons with cel-go's overflow errors, the getters with the UTC default and an
//!   optional zone (`±hh:mm` parsed as leniently as cel-go, or a zone name looked up in
//!   the system zoneinfo, as Go's `time.LoadLocation` does), the literal validators and
//!   the folding of constant conversions, no map/list index by these values — implemented;
//! - homogeneous aggregate literals, regex literal validation, cross-type numeric
//!   comparisons (cel-go's conversions), constant folding of conversions — implemented;
//! - optionals (latest: `optional.of/ofNonZeroValue/none`, `value`, `hasValue`, `or`,
//!   `orValue`, `.?`, `[?]`, `optMap`, `optFlatMap`, `first`, `last`,
//!   `optional.unwrap`, `unwrapOpt`) — implemented (`unwrap`, `unwrapOpt` added);
//! - cel-go strings (2): `charAt`, `indexOf`, `lastIndexOf`, `lowerAscii`,
//!   `upperAscii`, `replace`, `split`, `substring`, `trim`, `join`, `strings.quote` —
//!   implemented; `format` (module `string_format`: version 2's formatter, `%f` and
//!   `%e` as golang.org/x/text's en_US printer renders them — grouping, `∞`, the
//!   superscript exponent, `%e`'s precision taken as a width — `%s` of lists and maps
//!   as CEL-like literals, and the validator that checks calls with a literal format
//!   string and a list literal when compiling) — implemented; `reverse` on strings
//!   (version 3) — now refused, as upstream;
//! - cel-go sets, two-variable comprehensions, bindings (`cel.bind`), lists (3:
//!   `slice`, `flatten`, `sort`, `sortBy`, `lists.range`, `reverse`, `distinct`) —
//!   implemented;
//! - Kubernetes lists (0: `isSorted`, `sum`, `min`, `max`, `indexOf`, `lastIndexOf`) —
//!   implemented; lists 1 (`includes`, 1.37) is only in kube-scheduler's environment
//!   and refused, as the API server refuses it;
//! - Kubernetes regex (`find`, `findAll`), quantity, semver (1) — implemented;
//!   `sign` is global only and `mul` does not exist upstream: both now refused;
//! - Kubernetes IP and CIDR (module `net`: Go's `netip` parsing and printing, the
//!   libraries' refusal of zones and IPv4-mapped addresses) — implemented;
//! - Kubernetes URLs (module `url`: accepted by Go's `url.ParseRequestURI`, built by
//!   `url.Parse`, with Go 1.26's strict colons in http(s) hosts; components, `getQuery`
//!   unescaped, equality on Go's `String`; no identifier for the type, as upstream) and
//!   format (module `format`: every named format, `format.named`, `validate` with
//!   apimachinery's, `ParseRequestURI`'s and strfmt's checks and messages) —
//!   implemented. A URL or format compared with another type fails `==`, satisfies
//!   `!=` and is no match in list searches, as their `Equal` methods make cel-go do; a
//!   URL map key is its Go pointer, and neither type can index a map or list;
//! - Kubernetes authz libraries — no authorizer variable in this environment: their
//!   functions are refused;
//! - not in the environment (math, encoders, protos, ...) — refused, as upstream.
//!
//! [`compile`] is the API server's validation of a new selector; [`compile_stored`] is
//! kube-scheduler's compilation of a stored one, which skips the cost estimate (its
//! cache compiles with `DisableCostEstimation`). The placement engine uses the latter.
//!
//! The cost estimate follows cel-go's static model with the Kubernetes library's
//! estimator and DRA's size estimator (module `cost`); the runtime meter is this crate's
//! own, coarser than cel-go's tracker, and bounds every evaluation.
//! `operator/cel/corpus.txt` and the e2e test `cel_corpus` check all of this against
//! a real API server and kube-scheduler.
//!
//! Attributes are not copied into a map per evaluation: `device.attributes[domain]` is a
//! view that looks names up in the device's own tables. The crate also owns the value
//! types the expressions see: Kubernetes quantities ([`quantity`]) and device attributes
//! ([`device`]), in compact sorted maps ([`name_map`]).
#![forbid(unsafe_code)]

mod ast;
mod check;
mod cost;
mod decls;
pub mod device;
mod eval;
mod format;
mod functions;
mod lexer;
pub mod name_map;
mod names;
mod net;
mod parser;
pub mod quantity;
mod quote;
mod semver;
mod string_format;
mod time;
mod typed;
mod types;
mod url;
mod value;

#[cfg(test)]
mod tests;

use std::sync::Arc;

pub use crate::device::{AttributeValue, Attributes, CapacityTable, DeviceView};

/// Longest accepted expression, in bytes (`CELSelectorExpressionMaxLength`).
pub const MAX_EXPRESSION_LENGTH: usize = 10 * 1024;

/// Runtime cost budget of one evaluation (`CELSelectorExpressionMaxCost`).
pub const COST_LIMIT: u64 = 1_000_000;

/// Stack for parsing and checking; see [`compile`].
const COMPILE_STACK: usize = 32 << 20;

/// An expression that does not compile.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct CompileError {
    pub message: String,
}

/// An evaluation that did not produce a boolean.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct EvalError {
    pub message: String,
}

#[derive(Debug)]
struct Compiled {
    expression: String,
    root: ast::Node,
    slots: usize,
}

/// A compiled selector expression. Cheap to clone, and shareable across threads.
#[derive(Clone, Debug)]
pub struct Program {
    inner: Arc<Compiled>,
}

impl Program {
    pub fn expression(&self) -> &str {
        &self.inner.expression
    }

    /// Evaluates against one device: `Ok(true/false)`, or an error for a runtime error,
    /// a non-boolean result or an exceeded cost limit.
    pub fn evaluate(&self, device: &DeviceView<'_>) -> Result<bool, EvalError> {
        self.evaluate_with_limit(device, COST_LIMIT)
    }

    /// Like [`Program::evaluate`], with another cost limit.
    pub fn evaluate_with_limit(&self, device: &DeviceView<'_>, cost_limit: u64) -> Result<bool, EvalError> {
        let mut evaluator = eval::Evaluator::new(device, self.inner.slots, cost_limit);
        match evaluator.eval(&self.inner.root) {
            Ok(value::Value::Bool(b)) => Ok(b),
            Ok(other) => Err(EvalError {
                message: format!("expression must return a boolean, got {}", other.type_name()),
            }),
            Err(e) => Err(EvalError { message: e.message }),
        }
    }
}

/// Formats an error like cel-go: position, then the offending line with a caret.
fn compile_error(source: &str, pos: usize, message: &str) -> CompileError {
    let pos = pos.min(source.len());
    let before = source.get(..pos).unwrap_or(source);
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let line_no = before.matches('\n').count() + 1;
    let column = before[line_start..].chars().count();
    let line = source[line_start..].lines().next().unwrap_or("");
    CompileError {
        message: format!(
            "ERROR: <input>:{line_no}:{}: {message}\n | {line}\n | {}^",
            column + 1,
            ".".repeat(column)
        ),
    }
}

/// Compiles a new selector as the API server does when it validates one: also refused
/// when its estimated worst-case cost exceeds [`COST_LIMIT`].
pub fn compile(expression: &str) -> Result<Program, CompileError> {
    compile_with(expression, check::CostCheck::Estimate)
}

/// Compiles a stored selector as kube-scheduler does before it evaluates one: without
/// the cost estimate, which the API server applied when the selector was written (an
/// older or ratcheted one may exceed today's); the runtime limit bounds evaluation.
pub fn compile_stored(expression: &str) -> Result<Program, CompileError> {
    compile_with(expression, check::CostCheck::Skip)
}

fn compile_with(expression: &str, cost_check: check::CostCheck) -> Result<Program, CompileError> {
    if expression.len() > MAX_EXPRESSION_LENGTH {
        return Err(CompileError {
            message: format!(
                "expression is too long: {} bytes, at most {MAX_EXPRESSION_LENGTH} are allowed",
                expression.len()
            ),
        });
    }
    // Parsing and checking recurse once per nesting level (at most parser::MAX_DEPTH).
    // Unoptimised builds use several KiB of stack per level, more than a default 2 MiB
    // thread may have left, so they run on a thread with a known, generous stack.
    let run = || -> Result<check::Checked, CompileError> {
        let tokens = lexer::tokenize(expression).map_err(|e| compile_error(expression, e.pos, &e.message))?;
        let parsed = parser::parse(&tokens).map_err(|e| compile_error(expression, e.pos, &e.message))?;
        check::check(parsed, cost_check).map_err(|e| compile_error(expression, e.pos, &e.message))
    };
    let checked = std::thread::scope(|scope| {
        let handle = std::thread::Builder::new()
            .name("cel-compile".into())
            .stack_size(COMPILE_STACK)
            .spawn_scoped(scope, run)
            .map_err(|e| CompileError {
                message: format!("cannot start the compiler: {e}"),
            })?;
        handle.join().unwrap_or_else(|_| {
            Err(CompileError {
                message: "internal compiler error".into(),
            })
        })
    })?;
    Ok(Program {
        inner: Arc::new(Compiled {
            expression: expression.to_string(),
            root: checked.root,
            slots: checked.slots,
        }),
    })
}
