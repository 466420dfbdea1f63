//! The function declarations of the environment Kubernetes compiles DRA selectors in
//! (the "NewExpressions" environment of the API server; see the crate documentation).
//! Each overload: function, overload id (cel-go's, which the cost model keys on),
//! global or member, parameter types and result type.

use std::collections::HashMap;
use std::sync::OnceLock;

use crate::types::{Type, parse};

pub(crate) struct Overload {
    pub id: &'static str,
    pub member: bool,
    pub params: Vec<Type>,
    pub result: Type,
}

const G: bool = false;
const M: bool = true;

/// (function, overload id, member, parameters, result).
#[rustfmt::skip]
const TABLE: &[(&str, &str, bool, &str, &str)] = &[
    // Operators.
    ("_?_:_", "conditional", G, "bool, A, A", "A"),
    ("!_", "logical_not", G, "bool", "bool"),
    ("@not_strictly_false", "not_strictly_false", G, "bool", "bool"),
    ("-_", "negate_int64", G, "int", "int"),
    ("-_", "negate_double", G, "double", "double"),
    ("_==_", "equals", G, "A, A", "bool"),
    ("_!=_", "not_equals", G, "A, A", "bool"),
    ("_+_", "add_bytes", G, "bytes, bytes", "bytes"),
    ("_+_", "add_double", G, "double, double", "double"),
    ("_+_", "add_duration_duration", G, "duration, duration", "duration"),
    ("_+_", "add_duration_timestamp", G, "duration, timestamp", "timestamp"),
    ("_+_", "add_timestamp_duration", G, "timestamp, duration", "timestamp"),
    ("_+_", "add_int64", G, "int, int", "int"),
    ("_+_", "add_list", G, "list(A), list(A)", "list(A)"),
    ("_+_", "add_string", G, "string, string", "string"),
    ("_+_", "add_uint64", G, "uint, uint", "uint"),
    ("_/_", "divide_double", G, "double, double", "double"),
    ("_/_", "divide_int64", G, "int, int", "int"),
    ("_/_", "divide_uint64", G, "uint, uint", "uint"),
    ("_%_", "modulo_int64", G, "int, int", "int"),
    ("_%_", "modulo_uint64", G, "uint, uint", "uint"),
    ("_*_", "multiply_double", G, "double, double", "double"),
    ("_*_", "multiply_int64", G, "int, int", "int"),
    ("_*_", "multiply_uint64", G, "uint, uint", "uint"),
    ("_-_", "subtract_double", G, "double, double", "double"),
    ("_-_", "subtract_duration_duration", G, "duration, duration", "duration"),
    ("_-_", "subtract_int64", G, "int, int", "int"),
    ("_-_", "subtract_timestamp_duration", G, "timestamp, duration", "timestamp"),
    ("_-_", "subtract_timestamp_timestamp", G, "timestamp, timestamp", "duration"),
    ("_-_", "subtract_uint64", G, "uint, uint", "uint"),
    ("_[_]", "index_list", G, "list(A), int", "A"),
    ("_[_]", "index_map", G, "map(A, B), A", "B"),
    ("_[_]", "optional_list_index_int", G, "optional(list(V)), int", "optional(V)"),
    ("_[_]", "optional_map_index_value", G, "optional(map(K, V)), K", "optional(V)"),
    ("_[?_]", "list_optindex_optional_int", G, "list(V), int", "optional(V)"),
    ("_[?_]", "optional_list_optindex_optional_int", G, "optional(list(V)), int", "optional(V)"),
    ("_[?_]", "map_optindex_optional_value", G, "map(K, V), K", "optional(V)"),
    ("_[?_]", "optional_map_optindex_optional_value", G, "optional(map(K, V)), K", "optional(V)"),
    ("@in", "in_list", G, "A, list(A)", "bool"),
    ("@in", "in_map", G, "A, map(A, B)", "bool"),
    // Conversions and size.
    ("size", "size_bytes", G, "bytes", "int"),
    ("size", "bytes_size", M, "bytes", "int"),
    ("size", "size_list", G, "list(A)", "int"),
    ("size", "list_size", M, "list(A)", "int"),
    ("size", "size_map", G, "map(A, B)", "int"),
    ("size", "map_size", M, "map(A, B)", "int"),
    ("size", "size_string", G, "string", "int"),
    ("size", "string_size", M, "string", "int"),
    ("type", "type", G, "A", "type(A)"),
    ("dyn", "to_dyn", G, "A", "dyn"),
    ("bool", "bool_to_bool", G, "bool", "bool"),
    ("bool", "string_to_bool", G, "string", "bool"),
    ("bytes", "bytes_to_bytes", G, "bytes", "bytes"),
    ("bytes", "string_to_bytes", G, "string", "bytes"),
    ("double", "double_to_double", G, "double", "double"),
    ("double", "int64_to_double", G, "int", "double"),
    ("double", "string_to_double", G, "string", "double"),
    ("double", "uint64_to_double", G, "uint", "double"),
    ("duration", "duration_to_duration", G, "duration", "duration"),
    ("duration", "string_to_duration", G, "string", "duration"),
    ("int", "int64_to_int64", G, "int", "int"),
    ("int", "double_to_int64", G, "double", "int"),
    ("int", "duration_to_int64", G, "duration", "int"),
    ("int", "string_to_int64", G, "string", "int"),
    ("int", "timestamp_to_int64", G, "timestamp", "int"),
    ("int", "uint64_to_int64", G, "uint", "int"),
    ("string", "string_to_string", G, "string", "string"),
    ("string", "bool_to_string", G, "bool", "string"),
    ("string", "bytes_to_string", G, "bytes", "string"),
    ("string", "double_to_string", G, "double", "string"),
    ("string", "duration_to_string", G, "duration", "string"),
    ("string", "int64_to_string", G, "int", "string"),
    ("string", "timestamp_to_string", G, "timestamp", "string"),
    ("string", "uint64_to_string", G, "uint", "string"),
    ("string", "ip_to_string", G, "ip", "string"),
    ("string", "cidr_to_string", G, "cidr", "string"),
    ("timestamp", "timestamp_to_timestamp", G, "timestamp", "timestamp"),
    ("timestamp", "int64_to_timestamp", G, "int", "timestamp"),
    ("timestamp", "string_to_timestamp", G, "string", "timestamp"),
    ("uint", "uint64_to_uint64", G, "uint", "uint"),
    ("uint", "double_to_uint64", G, "double", "uint"),
    ("uint", "int64_to_uint64", G, "int", "uint"),
    ("uint", "string_to_uint64", G, "string", "uint"),
    // Strings of the standard library.
    ("contains", "contains_string", M, "string, string", "bool"),
    ("endsWith", "ends_with_string", M, "string, string", "bool"),
    ("startsWith", "starts_with_string", M, "string, string", "bool"),
    ("matches", "matches", G, "string, string", "bool"),
    ("matches", "matches_string", M, "string, string", "bool"),
    // Timestamps and durations.
    ("getFullYear", "timestamp_to_year", M, "timestamp", "int"),
    ("getFullYear", "timestamp_to_year_with_tz", M, "timestamp, string", "int"),
    ("getMonth", "timestamp_to_month", M, "timestamp", "int"),
    ("getMonth", "timestamp_to_month_with_tz", M, "timestamp, string", "int"),
    ("getDayOfYear", "timestamp_to_day_of_year", M, "timestamp", "int"),
    ("getDayOfYear", "timestamp_to_day_of_year_with_tz", M, "timestamp, string", "int"),
    ("getDayOfMonth", "timestamp_to_day_of_month", M, "timestamp", "int"),
    ("getDayOfMonth", "timestamp_to_day_of_month_with_tz", M, "timestamp, string", "int"),
    ("getDate", "timestamp_to_day_of_month_1_based", M, "timestamp", "int"),
    ("getDate", "timestamp_to_day_of_month_1_based_with_tz", M, "timestamp, string", "int"),
    ("getDayOfWeek", "timestamp_to_day_of_week", M, "timestamp", "int"),
    ("getDayOfWeek", "timestamp_to_day_of_week_with_tz", M, "timestamp, string", "int"),
    ("getHours", "timestamp_to_hours", M, "timestamp", "int"),
    ("getHours", "timestamp_to_hours_with_tz", M, "timestamp, string", "int"),
    ("getHours", "duration_to_hours", M, "duration", "int"),
    ("getMinutes", "timestamp_to_minutes", M, "timestamp", "int"),
    ("getMinutes", "timestamp_to_minutes_with_tz", M, "timestamp, string", "int"),
    ("getMinutes", "duration_to_minutes", M, "duration", "int"),
    ("getSeconds", "timestamp_to_seconds", M, "timestamp", "int"),
    ("getSeconds", "timestamp_to_seconds_with_tz", M, "timestamp, string", "int"),
    ("getSeconds", "duration_to_seconds", M, "duration", "int"),
    ("getMilliseconds", "timestamp_to_milliseconds", M, "timestamp", "int"),
    ("getMilliseconds", "timestamp_to_milliseconds_with_tz", M, "timestamp, string", "int"),
    ("getMilliseconds", "duration_to_milliseconds", M, "duration", "int"),
    // cel-go strings extension, version 2.
    ("charAt", "string_char_at_int", M, "string, int", "string"),
    ("indexOf", "string_index_of_string", M, "string, string", "int"),
    ("indexOf", "string_index_of_string_int", M, "string, string, int", "int"),
    ("lastIndexOf", "string_last_index_of_string", M, "string, string", "int"),
    ("lastIndexOf", "string_last_index_of_string_int", M, "string, string, int", "int"),
    ("lowerAscii", "string_lower_ascii", M, "string", "string"),
    ("upperAscii", "string_upper_ascii", M, "string", "string"),
    ("replace", "string_replace_string_string", M, "string, string, string", "string"),
    ("replace", "string_replace_string_string_int", M, "string, string, string, int", "string"),
    ("split", "string_split_string", M, "string, string", "list(string)"),
    ("split", "string_split_string_int", M, "string, string, int", "list(string)"),
    ("substring", "string_substring_int", M, "string, int", "string"),
    ("substring", "string_substring_int_int", M, "string, int, int", "string"),
    ("trim", "string_trim", M, "string", "string"),
    ("format", "string_format", M, "string, list(dyn)", "string"),
    ("strings.quote", "strings_quote", G, "string", "string"),
    ("join", "list_join", M, "list(string)", "string"),
    ("join", "list_join_string", M, "list(string), string", "string"),
    // cel-go sets extension.
    ("sets.contains", "list_sets_contains_list", G, "list(A), list(A)", "bool"),
    ("sets.equivalent", "list_sets_equivalent_list", G, "list(A), list(A)", "bool"),
    ("sets.intersects", "list_sets_intersects_list", G, "list(A), list(A)", "bool"),
    // cel-go lists extension, version 3, and the optional library's list functions.
    ("slice", "list_slice", M, "list(A), int, int", "list(A)"),
    ("flatten", "list_flatten", M, "list(list(A))", "list(A)"),
    ("flatten", "list_flatten_int", M, "list(dyn), int", "list(dyn)"),
    ("lists.range", "lists_range", G, "int", "list(int)"),
    ("reverse", "list_reverse", M, "list(A)", "list(A)"),
    ("distinct", "list_distinct", M, "list(A)", "list(A)"),
    ("first", "list_first", M, "list(A)", "optional(A)"),
    ("last", "list_last", M, "list(A)", "optional(A)"),
    // Optionals.
    ("optional.of", "optional_of", G, "V", "optional(V)"),
    ("optional.ofNonZeroValue", "optional_ofNonZeroValue", G, "V", "optional(V)"),
    ("optional.none", "optional_none", G, "", "optional(V)"),
    ("optional.unwrap", "optional_unwrap", G, "list(optional(V))", "list(V)"),
    ("unwrapOpt", "optional_unwrapOpt", M, "list(optional(V))", "list(V)"),
    ("value", "optional_value", M, "optional(V)", "V"),
    ("hasValue", "optional_hasValue", M, "optional(V)", "bool"),
    ("or", "optional_or_optional", M, "optional(V), optional(V)", "optional(V)"),
    ("orValue", "optional_orValue_value", M, "optional(V), V", "V"),
    // Two-variable comprehensions' map insertion (only reachable from the macros).
    ("cel.@mapInsert", "@mapInsert_map_key_value", G, "map(K, V), K, V", "map(K, V)"),
    ("cel.@mapInsert", "@mapInsert_map_map", G, "map(K, V), map(K, V)", "map(K, V)"),
    // Kubernetes URLs.
    ("url", "string_to_url", G, "string", "url"),
    ("isURL", "is_url_string", G, "string", "bool"),
    ("getScheme", "url_get_scheme", M, "url", "string"),
    ("getHost", "url_get_host", M, "url", "string"),
    ("getHostname", "url_get_hostname", M, "url", "string"),
    ("getPort", "url_get_port", M, "url", "string"),
    ("getEscapedPath", "url_get_escaped_path", M, "url", "string"),
    ("getQuery", "url_get_query", M, "url", "map(string, list(string))"),
    // Kubernetes regex.
    ("find", "string_find_string", M, "string, string", "string"),
    ("findAll", "string_find_all_string", M, "string, string", "list(string)"),
    ("findAll", "string_find_all_string_int", M, "string, string, int", "list(string)"),
    // Kubernetes quantities.
    ("quantity", "string_to_quantity", G, "string", "quantity"),
    ("isQuantity", "is_quantity_string", G, "string", "bool"),
    ("sign", "quantity_sign", G, "quantity", "int"),
    ("isGreaterThan", "quantity_is_greater_than", M, "quantity, quantity", "bool"),
    ("isLessThan", "quantity_is_less_than", M, "quantity, quantity", "bool"),
    ("compareTo", "quantity_compare_to", M, "quantity, quantity", "int"),
    ("asApproximateFloat", "quantity_get_float", M, "quantity", "double"),
    ("asInteger", "quantity_get_int", M, "quantity", "int"),
    ("isInteger", "quantity_is_integer", M, "quantity", "bool"),
    ("add", "quantity_add", M, "quantity, quantity", "quantity"),
    ("add", "quantity_add_int", M, "quantity, int", "quantity"),
    ("sub", "quantity_sub", M, "quantity, quantity", "quantity"),
    ("sub", "quantity_sub_int", M, "quantity, int", "quantity"),
    // Kubernetes semantic versions, version 1.
    ("semver", "string_to_semver", G, "string", "semver"),
    ("semver", "string_bool_to_semver", G, "string, bool", "semver"),
    ("isSemver", "is_semver_string", G, "string", "bool"),
    ("isSemver", "is_semver_string_bool", G, "string, bool", "bool"),
    ("isGreaterThan", "semver_is_greater_than", M, "semver, semver", "bool"),
    ("isLessThan", "semver_is_less_than", M, "semver, semver", "bool"),
    ("compareTo", "semver_compare_to", M, "semver, semver", "int"),
    ("major", "semver_major", M, "semver", "int"),
    ("minor", "semver_minor", M, "semver", "int"),
    ("patch", "semver_patch", M, "semver", "int"),
    // Kubernetes IP addresses and CIDRs.
    ("ip", "string_to_ip", G, "string", "ip"),
    ("isIP", "is_ip", G, "string", "bool"),
    ("ip.isCanonical", "ip_is_canonical", G, "string", "bool"),
    ("family", "ip_family", M, "ip", "int"),
    ("isUnspecified", "ip_is_unspecified", M, "ip", "bool"),
    ("isLoopback", "ip_is_loopback", M, "ip", "bool"),
    ("isLinkLocalMulticast", "ip_is_link_local_multicast", M, "ip", "bool"),
    ("isLinkLocalUnicast", "ip_is_link_local_unicast", M, "ip", "bool"),
    ("isGlobalUnicast", "ip_is_global_unicast", M, "ip", "bool"),
    ("cidr", "string_to_cidr", G, "string", "cidr"),
    ("isCIDR", "is_cidr", G, "string", "bool"),
    ("containsIP", "cidr_contains_ip_string", M, "cidr, string", "bool"),
    ("containsIP", "cidr_contains_ip_ip", M, "cidr, ip", "bool"),
    ("containsCIDR", "cidr_contains_cidr_string", M, "cidr, string", "bool"),
    ("containsCIDR", "cidr_contains_cidr", M, "cidr, cidr", "bool"),
    ("ip", "cidr_ip", M, "cidr", "ip"),
    ("prefixLength", "cidr_prefix_length", M, "cidr", "int"),
    ("masked", "cidr_masked", M, "cidr", "cidr"),
    // Kubernetes named formats.
    ("validate", "format-validate", M, "format, string", "optional(list(string))"),
    ("format.named", "format-named", G, "string", "optional(format)"),
    ("format.dns1123Label", "format.dns1123Label", G, "", "format"),
    ("format.dns1123Subdomain", "format.dns1123Subdomain", G, "", "format"),
    ("format.dns1035Label", "format.dns1035Label", G, "", "format"),
    ("format.qualifiedName", "format.qualifiedName", G, "", "format"),
    ("format.dns1123LabelPrefix", "format.dns1123LabelPrefix", G, "", "format"),
    ("format.dns1123SubdomainPrefix", "format.dns1123SubdomainPrefix", G, "", "format"),
    ("format.dns1035LabelPrefix", "format.dns1035LabelPrefix", G, "", "format"),
    ("format.labelValue", "format.labelValue", G, "", "format"),
    ("format.uri", "format.uri", G, "", "format"),
    ("format.uuid", "format.uuid", G, "", "format"),
    ("format.byte", "format.byte", G, "", "format"),
    ("format.date", "format.date", G, "", "format"),
    ("format.datetime", "format.datetime", G, "", "format"),
];

/// Element types of the Kubernetes list library (`isSorted`, `min`, `max`) and of the
/// cel-go `sort`.
const COMPARABLE: &[&str] = &[
    "int",
    "uint",
    "double",
    "bool",
    "duration",
    "timestamp",
    "string",
    "bytes",
];
/// The operand types of `<`, `<=`, `>`, `>=` (with cross-type numeric comparisons).
const ORDERED: &[(&str, &str, &str)] = &[
    ("bool", "bool", "bool"),
    ("int64", "int", "int"),
    ("int64_double", "int", "double"),
    ("int64_uint64", "int", "uint"),
    ("uint64", "uint", "uint"),
    ("uint64_double", "uint", "double"),
    ("uint64_int64", "uint", "int"),
    ("double", "double", "double"),
    ("double_int64", "double", "int"),
    ("double_uint64", "double", "uint"),
    ("string", "string", "string"),
    ("bytes", "bytes", "bytes"),
    ("timestamp", "timestamp", "timestamp"),
    ("duration", "duration", "duration"),
];
const SUMMABLE: &[&str] = &["int", "uint", "double", "duration"];

fn build() -> HashMap<&'static str, Vec<Overload>> {
    let mut out: HashMap<&'static str, Vec<Overload>> = HashMap::new();
    let mut add = |name: &'static str, id: &'static str, member: bool, params: &str, result: &str| {
        let params = if params.trim().is_empty() {
            Vec::new()
        } else {
            split_params(params).into_iter().map(parse).collect()
        };
        out.entry(name).or_default().push(Overload {
            id,
            member,
            params,
            result: parse(result),
        });
    };
    for &(name, id, member, params, result) in TABLE {
        add(name, id, member, params, result);
    }
    // Templated overloads, one per element type; their ids only matter for costs.
    for &t in COMPARABLE {
        let list = format!("list({t})");
        add("isSorted", "list_is_sorted_bool", M, &list, "bool");
        add("max", "list_max", M, &list, t);
        add("min", "list_min", M, &list, t);
        add("sort", "list_sort", M, &list, &list);
    }
    for &t in SUMMABLE {
        add("sum", "list_sum", M, &format!("list({t})"), t);
    }
    for (op, prefix) in [
        ("_<_", "less"),
        ("_<=_", "less_equals"),
        ("_>_", "greater"),
        ("_>=_", "greater_equals"),
    ] {
        for (suffix, a, b) in ORDERED {
            // Built once per process: the ids live as long as the table.
            let id: &'static str = Box::leak(format!("{prefix}_{suffix}").into_boxed_str());
            add(op, id, G, &format!("{a}, {b}"), "bool");
        }
    }
    add("indexOf", "list_a_index_of_int", M, "list(A), A", "int");
    add("lastIndexOf", "list_a_last_index_of_int", M, "list(A), A", "int");
    for &t in COMPARABLE {
        add(
            "@sortByAssociatedKeys",
            "list_sortByAssociatedKeys",
            M,
            &format!("list(A), list({t})"),
            "list(A)",
        );
    }
    out
}

fn split_params(text: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut depth = 0;
    let mut start = 0;
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&text[start..]);
    parts
}

/// The overloads of a function, if it is declared.
pub(crate) fn lookup(name: &str) -> Option<&'static [Overload]> {
    static DECLS: OnceLock<HashMap<&'static str, Vec<Overload>>> = OnceLock::new();
    DECLS.get_or_init(build).get(name).map(Vec::as_slice)
}
