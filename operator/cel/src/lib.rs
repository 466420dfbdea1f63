//! CEL device selectors, evaluated as kube-scheduler evaluates them.
//!
//! An interpreter for the Common Expression Language with the environment Kubernetes
//! gives DRA device selectors: the `device` variable (driver, attributes, capacity,
//! allowMultipleAllocations), the standard library, the cel-go extensions of the
//! Kubernetes base environment (strings, lists, sets, optionals, two-variable
//! comprehensions, `cel.bind`) and the Kubernetes libraries (lists, regex, quantity,
//! semver).
//!
//! Attributes are not copied into a map per evaluation: `device.attributes[domain]` is a
//! view that looks names up in the device's own tables.
//!
//! The crate also owns the value types the expressions see: Kubernetes quantities
//! ([`quantity`]) and device attributes ([`device`]), in compact sorted maps
//! ([`name_map`]).
#![forbid(unsafe_code)]

mod ast;
mod check;
mod cost;
mod decls;
pub mod device;
mod eval;
mod functions;
mod lexer;
pub mod name_map;
mod parser;
pub mod quantity;
mod semver;
mod types;
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

/// Compiles a selector expression.
pub fn compile(expression: &str) -> Result<Program, CompileError> {
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
        check::check(parsed).map_err(|e| compile_error(expression, e.pos, &e.message))
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
