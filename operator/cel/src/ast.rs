//! The checked tree the evaluator walks: names resolved to variable slots, the device
//! or type constants; calls resolved to functions.

use std::sync::Arc;

use crate::names::Func;
use crate::parser::{BinOp, CompKind};
use crate::value::TypeName;

#[derive(Debug)]
pub(crate) enum Const {
    Null,
    Bool(bool),
    Int(i64),
    Uint(u64),
    Double(f64),
    String(Arc<str>),
    Bytes(Arc<[u8]>),
    Type(TypeName),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DeviceField {
    Driver,
    Attributes,
    Capacity,
    AllowMultipleAllocations,
}

impl DeviceField {
    pub(crate) fn from_name(name: &str) -> Option<DeviceField> {
        Some(match name {
            "driver" => DeviceField::Driver,
            "attributes" => DeviceField::Attributes,
            "capacity" => DeviceField::Capacity,
            "allowMultipleAllocations" => DeviceField::AllowMultipleAllocations,
            _ => return None,
        })
    }
}

#[derive(Debug)]
pub(crate) struct Comp {
    pub kind: CompKind,
    pub range: Node,
    pub slot1: usize,
    pub slot2: Option<usize>,
    pub filter: Option<Node>,
    pub body: Node,
}

#[derive(Debug)]
pub(crate) enum Node {
    Const(Const),
    Local(usize),
    Device,
    DeviceField(DeviceField),
    Select {
        operand: Box<Node>,
        field: String,
        optional: bool,
    },
    Has {
        operand: Box<Node>,
        field: String,
    },
    Index {
        operand: Box<Node>,
        index: Box<Node>,
        optional: bool,
    },
    /// A function call; for methods the receiver is `args[0]`. `regex` holds a
    /// pattern argument compiled at compile time.
    Call {
        func: Func,
        args: Vec<Node>,
        regex: Option<Arc<regex::Regex>>,
    },
    Not(Box<Node>),
    Neg(Box<Node>),
    Binary(BinOp, Box<Node>, Box<Node>),
    And(Box<Node>, Box<Node>),
    Or(Box<Node>, Box<Node>),
    Cond(Box<Node>, Box<Node>, Box<Node>),
    List(Vec<(Node, bool)>),
    Map(Vec<(Node, Node, bool)>),
    Comprehension(Box<Comp>),
    Bind {
        slot: usize,
        init: Box<Node>,
        body: Box<Node>,
    },
}
