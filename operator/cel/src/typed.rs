//! The typed tree the checker produces: what the cost estimator and the format
//! validation read before the tree is lowered for the evaluator.

use crate::ast::Const;
use crate::parser::CompKind;
use crate::types::Type;
use crate::value::TypeName;

/// A checked expression: its type, and what the cost estimator needs to know.
pub(crate) struct TNode {
    pub pos: usize,
    pub ty: Type,
    pub kind: TKind,
}

pub(crate) enum TKind {
    Const(Const),
    /// A comprehension or binding variable.
    Local {
        slot: usize,
    },
    Device,
    /// A type identifier such as `int`.
    TypeIdent(TypeName),
    Select {
        operand: Box<TNode>,
        field: String,
        optional: bool,
    },
    Has {
        operand: Box<TNode>,
        field: String,
    },
    Index {
        operand: Box<TNode>,
        index: Box<TNode>,
        optional: bool,
    },
    /// Functions and operators alike; for methods the receiver is `args[0]`.
    Call {
        function: String,
        member: bool,
        overloads: Vec<&'static str>,
        args: Vec<TNode>,
    },
    List(Vec<(TNode, bool)>),
    Map(Vec<(TNode, TNode, bool)>),
    Comprehension(Box<TComp>),
    Bind {
        slot: usize,
        init: Box<TNode>,
        body: Box<TNode>,
    },
}

pub(crate) struct TComp {
    pub kind: CompKind,
    pub range: TNode,
    pub slot1: usize,
    pub slot2: Option<usize>,
    pub filter: Option<TNode>,
    pub body: TNode,
    /// For `sortBy`: the key type, which picks the sort's cost.
    pub aux: Type,
}
