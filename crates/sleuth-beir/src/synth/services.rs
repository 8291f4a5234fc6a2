//! The services family: an operations wiki. Services have lower-case
//! hyphenated names (`kaquka-brou`); each is written in a language, stores
//! data in a datastore, calls another service for downstream work and is
//! owned by a team. A team's page lists every service it owns, so it is
//! judged for many questions (a hub). People lead teams or work in them
//! and are on call on a weekday; incidents (`INC-4821`) hit a service and
//! were fixed by someone.
//!
//! - **language** (1 search): "Which language is kaquka-brou written in?"
//! - **callee_store** (2): "What datastore backs the dependency of
//!   kaquka-brou?": the service's page names the service it calls, whose
//!   page answers.
//! - **incident_team** (3): "Which group is responsible for the system
//!   affected by INC-4821?": incident, service, team page.
//! - **incident_lead_day** (4): "On which weekday is the head of the group
//!   responsible for the system affected by INC-4821 reachable?": incident,
//!   service, team page, the lead's page.
//!
//! Distractors: release notes that name two services, and team news that
//! names a team. Every split has teams, people and services of its own.

use super::{Names, Question, Rng, World, draw_split, in_split, places};

const LANGUAGES: &[&str] = &["Elixir", "Go", "Rust", "Java", "Python", "Kotlin", "Scala", "Haskell"];
const DATASTORES: &[&str] = &["Postgres", "DynamoDB", "Redis", "Cassandra", "MySQL", "Elasticsearch", "SQLite"];
const WEEKDAYS: &[&str] = &["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"];
const CHANGES: &[&str] = &["logging", "retries", "timeouts", "metrics", "caching"];
const NEWS: &[&str] = &["held an offsite", "hired two engineers", "moved offices", "ran a game day"];

/// Every word the document and question templates use (names must differ).
const TEMPLATE_WORDS: &[&str] = &[
    "written",
    "stores",
    "data",
    "calls",
    "downstream",
    "work",
    "owned",
    "team",
    "owns",
    "lead",
    "leads",
    "works",
    "call",
    "inc",
    "returned",
    "errors",
    "minutes",
    "fixed",
    "release",
    "changed",
    "language",
    "datastore",
    "backs",
    "dependency",
    "group",
    "responsible",
    "system",
    "affected",
    "weekday",
    "head",
    "reachable",
    "news",
];

struct Service {
    name: String,
    language: &'static str,
    datastore: &'static str,
    /// The service it calls (another of its split's, or itself when alone).
    callee: usize,
    team: usize,
    split: &'static str,
}

struct Person {
    name: String,
    team: usize,
    leads: bool,
    weekday: &'static str,
}

/// The wiki of `services` services, drawn from `rng`.
pub(crate) fn world(rng: &mut Rng, services: usize) -> World {
    let vocabulary = [TEMPLATE_WORDS, LANGUAGES, DATASTORES, WEEKDAYS, CHANGES, NEWS];
    let mut names = Names::new(vocabulary.into_iter().flatten().flat_map(|phrase| phrase.split(' ')));
    let split_of: Vec<&'static str> = (0..services).map(|_| draw_split(rng)).collect();
    let team_split = places(rng, services / 6);
    let teams = team_split.len();
    let team_names: Vec<String> = (0..teams).map(|_| names.fresh(rng, 2)).collect();
    let mut people: Vec<Person> = Vec::new();
    for team in 0..teams {
        for leads in [true, false, false] {
            let name = format!("{} {}", names.fresh(rng, 2), names.fresh(rng, 3));
            people.push(Person { name, team, leads, weekday: rng.pick(WEEKDAYS) });
        }
    }
    let mut all: Vec<Service> = (0..services)
        .map(|i| {
            let own_teams = in_split(&team_split, split_of[i]);
            Service {
                name: format!("{}-{}", names.fresh(rng, 2).to_lowercase(), names.fresh(rng, 1).to_lowercase()),
                language: rng.pick(LANGUAGES),
                datastore: rng.pick(DATASTORES),
                callee: i,
                team: own_teams[rng.below(own_teams.len())],
                split: split_of[i],
            }
        })
        .collect();
    for i in 0..services {
        let others: Vec<usize> = in_split(&split_of, split_of[i]).into_iter().filter(|&j| j != i).collect();
        if !others.is_empty() {
            all[i].callee = others[rng.below(others.len())];
        }
    }
    let lead = |team: usize| people.iter().position(|p| p.team == team && p.leads).expect("every team has a lead");

    let service_text = |s: &Service| {
        format!(
            "{} is written in {}. It stores data in {} and calls {} for downstream work. Owned by the {} team.",
            s.name, s.language, s.datastore, all[s.callee].name, team_names[s.team]
        )
    };
    let person_text = |p: &Person| {
        let role = if p.leads { "leads" } else { "works on" };
        format!("{} {role} the {} team and is on call on {}s.", p.name, team_names[p.team], p.weekday)
    };
    let team_text = |team: usize| {
        let owned: Vec<&str> = all.iter().filter(|s| s.team == team).map(|s| s.name.as_str()).collect();
        let owned = if owned.is_empty() { "no services yet".to_owned() } else { owned.join(", ") };
        format!("The {} team owns {owned}. Its lead is {}.", team_names[team], people[lead(team)].name)
    };
    let mut corpus: Vec<(String, String, String)> = Vec::new();
    for (i, service) in all.iter().enumerate() {
        corpus.push((format!("s{i}"), service.name.clone(), service_text(service)));
        let other = &all[rng.below(all.len())].name;
        let note = format!(
            "{} release {}.{} changed {} in calls to {other}.",
            service.name,
            1 + rng.below(4),
            rng.below(20),
            rng.pick(CHANGES)
        );
        corpus.push((format!("ds{i}"), format!("{} release notes", service.name), note));
    }
    for (team, name) in team_names.iter().enumerate() {
        let title = format!("{name} team");
        corpus.push((format!("t{team}"), title.clone(), team_text(team)));
        let news = format!("The {name} team {}.", rng.pick(NEWS));
        corpus.push((format!("dt{team}"), format!("{title} news"), news));
    }
    for (i, person) in people.iter().enumerate() {
        corpus.push((format!("p{i}"), person.name.clone(), person_text(person)));
    }
    let mut incident_ids: Vec<u32> = Vec::new();
    let mut questions = Vec::new();
    for (i, service) in all.iter().enumerate() {
        let mut id = 1000 + rng.below(9000) as u32;
        while incident_ids.contains(&id) {
            id = 1000 + rng.below(9000) as u32;
        }
        incident_ids.push(id);
        let incident = format!("INC-{id}");
        let fixer = people.iter().filter(|p| p.team == service.team).nth(1 + rng.below(2)).expect("three per team");
        let text = format!(
            "{incident}: {} returned errors for {} minutes. {} fixed it.",
            service.name,
            5 + rng.below(120),
            fixer.name
        );
        corpus.push((format!("i{i}"), incident.clone(), text));

        let (svc, inc, team) = (format!("s{i}"), format!("i{i}"), format!("t{}", service.team));
        let head = lead(service.team);
        let mut ask =
            |kind: &'static str, text: String, judged: Vec<(String, i32)>, answer_text: String, answer: &str| {
                let (split, id, answer) = (service.split, format!("q{i}-{kind}"), answer.to_owned());
                questions.push(Question { split, id, kind, text, judged, answer_text, answer });
            };
        ask(
            "language",
            format!("Which language is {} written in?", service.name),
            vec![(svc.clone(), 2)],
            service_text(service),
            service.language,
        );
        // Asked only where the dependency's page does not name the service back.
        if service.callee != i && all[service.callee].callee != i {
            let callee = &all[service.callee];
            ask(
                "callee_store",
                format!("What datastore backs the dependency of {}?", service.name),
                vec![(format!("s{}", service.callee), 2), (svc.clone(), 1)],
                service_text(callee),
                callee.datastore,
            );
        }
        ask(
            "incident_team",
            format!("Which group is responsible for the system affected by {incident}?"),
            vec![(team.clone(), 2), (svc.clone(), 1), (inc.clone(), 1)],
            team_text(service.team),
            &team_names[service.team],
        );
        ask(
            "incident_lead_day",
            format!(
                "On which weekday is the head of the group responsible for the system affected by {incident} reachable?"
            ),
            vec![(format!("p{head}"), 2), (team, 1), (svc, 1), (inc, 1)],
            person_text(&people[head]),
            people[head].weekday,
        );
    }
    World { corpus, questions }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use crate::synth::{Family, SynthSpec, write};

    #[test]
    fn every_seed_keeps_the_multi_hop_promise_with_one_to_four_hops() {
        // 635102 at the demo's size drew a service named after a language.
        for (seed, size) in (0..30).map(|seed| (seed, 12)).chain([(635102, 200)]) {
            let dir = tempfile::tempdir().unwrap();
            let made = write(dir.path(), SynthSpec { family: Family::Services, seed, size }).unwrap();
            assert!(made.questions.values().all(|&n| n > 0), "seed {seed}: {made:?}");
        }
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), SynthSpec { family: Family::Services, seed: 4, size: 60 }).unwrap();
        let beir = crate::BeirDir::new(dir.path());
        let mut hops: BTreeMap<usize, usize> = BTreeMap::new();
        let mut judged_by: BTreeMap<String, usize> = BTreeMap::new();
        for split in ["train", "validation", "test"] {
            for docs in beir.qrels(split).unwrap().values() {
                *hops.entry(docs.len()).or_default() += 1;
                for doc in docs.keys() {
                    *judged_by.entry(doc.clone()).or_default() += 1;
                }
            }
        }
        assert_eq!(hops.keys().copied().collect::<Vec<_>>(), [1, 2, 3, 4], "{hops:?}");
        assert!(judged_by.values().any(|&n| n >= 10), "a team page is a hub: {judged_by:?}");
        let corpus: Vec<String> = beir.corpus(crate::BadLines::Fail).unwrap().map(|d| d.unwrap().text).collect();
        assert!(corpus.iter().any(|text| text.contains("INC-") && text.contains('-')), "identifiers in the text");
    }
}
